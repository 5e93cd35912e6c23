"""Read a profile trace for replay: per prompt, the columns the replay and explain need.

A trace recorded with a drafter holds, at every step t of the target's greedy path,
the target's greedy token, the drafter's top-16 ids (teacher-forced on the same
prefix), every rule's accept/certify flags and radii.  ``draftcert-trace/2`` adds
``accept_mask/<spec>`` (which of the drafter's top-16 the rule accepts),
``draft_topk_target_logp`` and ``draft_token_target_rank``; older traces are read
too, and only the replays that need the new columns (relaxed rules on trees) are
skipped, with a note saying so.

A feature (EAGLE-style) drafter drafts depth >= 2 from its own predicted features; its
``draftcert-trace/3`` trace adds the drafter's own rollouts (``profile/rollout.py``): per row,
its top-m at depths 2..D for that row's token (``rollout_topk_ids``), their log p, the top-2
logit gap, and per level-set rule the accepted ranks (``rollout_accept_mask/<spec>``).  Its
first round drafts nothing (the engine has no target feature before the prefill).  A feature
drafter's trace/2 (no rollouts) is read with a note: exact at depth 1 only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["PromptTrace", "ReplayTrace", "load_replay_trace", "NO_DRAFTER_MESSAGE"]

NO_DRAFTER_MESSAGE = (
    "{where} was recorded without a drafter, so it holds no drafter proposals to replay. "
    "Record one with a drafter, e.g. `draftcert profile --drafter default --prompts mt-bench "
    "--out DIR` (any --drafter spec works: self:skip=L, self:quant=B, a path or hub id)"
)


@dataclass
class PromptTrace:
    """One prompt's steps, in position order 0..T-1 (arrays of length T)."""

    id: str
    target_token: np.ndarray  # (T,) int64
    draft_ids: np.ndarray  # (T, K) int64: drafter's top-K, rank order
    accepted: dict[str, np.ndarray]  # spec -> (T,) bool: the rule accepts the drafter's rank-0 token
    accept_mask: dict[str, np.ndarray]  # spec -> (T,) int64 bit mask over the drafter's top-K (trace/2)
    draft_logp: np.ndarray | None  # (T, K) float64: log p of the drafter's top-K (trace/2)
    draft_probs: np.ndarray | None  # (T, K) float64: q of the drafter's top-K
    target_topk_ids: np.ndarray  # (T, K) int64
    target_topk_probs: np.ndarray  # (T, K) float64
    margin: np.ndarray
    kl: np.ndarray
    radius: dict[str, np.ndarray]
    certified: dict[str, np.ndarray]
    draft_rank: np.ndarray | None  # (T,) rank of the drafter's token under p (trace/2)
    broken: np.ndarray  # (T,) bool: target or drafter logits non-finite
    # feature drafters (trace/3): proposals at depths 2..D for row t's token, depth-major
    roll_ids: np.ndarray | None = None  # (T, D - 1, m) int64, -1 = no such round
    roll_logp: np.ndarray | None = None  # (T, D - 1, m) float64
    roll_gap: np.ndarray | None = None  # (T, D - 1) float64: top-2 logit gap of the drafter
    roll_mask: dict[str, np.ndarray] = field(default_factory=dict)  # spec -> (T, D - 1) int64

    def __len__(self) -> int:
        return int(self.target_token.shape[0])


@dataclass
class ReplayTrace:
    out_dir: Path | None
    run: dict
    specs: list[str]
    max_new_tokens: int
    prompts: list[PromptTrace]
    topk: int
    notes: list[str] = field(default_factory=list)
    feature: bool = False  # a feature drafter: the first round drafts nothing
    rollout: tuple[int, int] | None = None  # (depth, top-m) of the recorded rollouts

    @property
    def max_depth(self) -> int | None:
        """Deepest draft depth replayed exactly for this drafter (None: any)."""
        if not self.feature:
            return None
        return self.rollout[0] if self.rollout else 1

    @property
    def has_masks(self) -> bool:
        return all(p.accept_mask for p in self.prompts) and bool(self.prompts)

    @property
    def steps(self) -> int:
        return sum(len(p) for p in self.prompts)


def _shards(out_dir: Path) -> list[Path]:
    from ..report.summary import list_shards

    return list_shards(out_dir)


def load_replay_trace(out_dir) -> ReplayTrace:
    """Load ``DIR/trace/*.parquet`` and ``DIR/run.json`` for replay (ValueError on bad input)."""
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    shards = _shards(out_dir)
    run: dict = {}
    if (out_dir / "run.json").exists():
        try:
            run = json.loads((out_dir / "run.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"run.json: {out_dir / 'run.json'} is not valid JSON ({exc})") from None
    cols: dict[str, list] = {}
    specs: list[str] | None = None
    masks_everywhere = True
    for path in shards:
        try:
            f = pq.ParquetFile(path)
            names = f.schema_arrow.names
        except Exception as exc:
            raise ValueError(f"trace shard {path} cannot be read ({type(exc).__name__}: {exc}); delete it and rerun "
                             "`draftcert profile` with the same arguments") from None
        if "draft_token" not in names:
            raise ValueError(NO_DRAFTER_MESSAGE.format(where=f"the trace in {out_dir}"))
        sp = [c.split("/", 1)[1] for c in names if c.startswith("accepted/")]
        if specs is None:
            specs = sp
        elif sp != specs:
            raise ValueError(f"trace shard {path} has other criteria ({sp}) than the others ({specs}); the directory "
                             "mixes runs: profile into a fresh --out directory")
        want = ["prompt_id", "position", "target_token", "target_margin", "target_topk_ids", "target_topk_probs",
                "draft_topk_ids", "kl_forward"]
        opt = ["nonfinite", "draft_nonfinite", "draft_topk_target_logp", "draft_token_target_rank", "draft_topk_probs",
               "rollout_topk_ids", "rollout_topk_target_logp", "rollout_logit_gap"]
        per = [f"{k}/{s}" for s in sp for k in ("accepted", "certified", "radius")]
        masks = [f"accept_mask/{s}" for s in sp if f"accept_mask/{s}" in names]
        masks += [f"rollout_accept_mask/{s}" for s in sp if f"rollout_accept_mask/{s}" in names]
        if "draft_topk_target_logp" not in names:
            masks_everywhere = False
        t = f.read(columns=want + [c for c in opt if c in names] + [c for c in per if c in names] + masks)
        for name in t.column_names:
            cols.setdefault(name, []).append(t.column(name))
        for name in opt:  # keep the shards aligned when an optional column is missing in some
            if name not in t.column_names:
                cols.setdefault(name, []).append(None)
    import pyarrow as pa

    def flat(name):
        parts = cols.get(name)
        if not parts or any(p is None for p in parts):
            return None
        return pa.chunked_array([c for p in parts for c in p.chunks], type=parts[0].type)

    def np1(name, dtype):
        a = flat(name)
        return None if a is None else a.to_numpy().astype(dtype)

    def np2(name, dtype):
        a = flat(name)
        if a is None:
            return None
        a = a.combine_chunks()
        k = len(a[0]) if len(a) else 0
        return a.flatten().to_numpy(zero_copy_only=False).astype(dtype).reshape(-1, k)

    pid = np.asarray(flat("prompt_id").to_pylist(), dtype=object)
    pos = np1("position", np.int64)
    order = np.lexsort((pos, pid))
    pid, pos = pid[order], pos[order]
    n = pid.shape[0]
    get1 = lambda name, dt: (lambda a: None if a is None else a[order])(np1(name, dt))  # noqa: E731
    get2 = lambda name, dt: (lambda a: None if a is None else a[order])(np2(name, dt))  # noqa: E731
    tt = get1("target_token", np.int64)
    dids = get2("draft_topk_ids", np.int64)
    tids = get2("target_topk_ids", np.int64)
    tprobs = get2("target_topk_probs", np.float64)
    margin = get1("target_margin", np.float64)
    kl = get1("kl_forward", np.float64)
    bad = np.zeros(n, bool)
    for name in ("nonfinite", "draft_nonfinite"):
        v = get1(name, bool)
        if v is not None:
            bad |= v
    bad |= ~np.isfinite(kl)
    dlogp = get2("draft_topk_target_logp", np.float64)
    dprobs = get2("draft_topk_probs", np.float64)
    drank = get1("draft_token_target_rank", np.int64)
    acc = {s: get1(f"accepted/{s}", bool) for s in specs}
    cert = {s: get1(f"certified/{s}", bool) for s in specs}
    rad = {s: get1(f"radius/{s}", np.float64) for s in specs}
    masks = {}
    if masks_everywhere:
        for s in specs:
            if len(cols.get(f"accept_mask/{s}", [])) == len(shards):  # present in every shard
                masks[s] = get1(f"accept_mask/{s}", np.int64)
    settings = run.get("settings") or {}
    rollout = settings.get("rollout")
    roll_ids = get2("rollout_topk_ids", np.int64) if rollout else None
    roll_logp = get2("rollout_topk_target_logp", np.float64) if rollout else None
    roll_gap = get2("rollout_logit_gap", np.float64) if rollout else None
    roll_masks = {}
    if roll_ids is not None:
        depth, width = int(rollout[0]), int(rollout[1])
        roll_ids = roll_ids.reshape(n, depth - 1, width)
        roll_logp = roll_logp.reshape(n, depth - 1, width)
        for s in specs:
            if len(cols.get(f"rollout_accept_mask/{s}", [])) == len(shards):
                roll_masks[s] = get2(f"rollout_accept_mask/{s}", np.int64)
    elif rollout:
        raise ValueError(f"trace in {out_dir}: run.json says rollouts were recorded but the shards lack "
                         "rollout_topk_ids; the directory mixes runs: profile into a fresh --out directory")
    notes = []
    dspec = run.get("drafter") or settings.get("drafter")
    feature = bool(rollout) or (isinstance(dspec, str) and _is_feature_drafter(dspec))
    if feature and roll_ids is None:
        notes.append(f"drafter {dspec} is a feature drafter and this trace ({run.get('format', 'draftcert-trace/2')}) "
                     "lacks its own rollouts: it scores the drafter on the target's own hidden states at every "
                     "position, while in decoding its drafts at depth >= 2 condition on its own predicted features; "
                     "replay is exact at depth 1 and an estimate deeper, strict rules included. Re-record it with "
                     "this version of `draftcert profile` (draftcert-trace/3) for exact replay at every depth")
    if not masks_everywhere:
        notes.append("trace format draftcert-trace/1 (no accept_mask/<spec>): relaxed rules are replayed as chains "
                     "only; re-record with this version of `draftcert profile` to replay them on trees")
    # split per prompt
    prompts = []
    bounds = np.flatnonzero(np.r_[True, pid[1:] != pid[:-1], True])
    for a, b in zip(bounds[:-1], bounds[1:]):
        p = pid[a]
        if not np.array_equal(pos[a:b], np.arange(b - a)):
            raise ValueError(f"trace: prompt {p!r} has positions {pos[a:b][:5].tolist()}... instead of 0..{b - a - 1}; "
                             "the trace is incomplete or mixes runs: rerun `draftcert profile` with the same arguments")
        sl = slice(a, b)
        prompts.append(PromptTrace(
            id=str(p), target_token=tt[sl], draft_ids=dids[sl],
            accepted={s: v[sl] & ~bad[sl] for s, v in acc.items()},
            accept_mask={s: np.where(bad[sl], 0, v[sl]) for s, v in masks.items()},
            draft_logp=None if dlogp is None else dlogp[sl], draft_probs=None if dprobs is None else dprobs[sl],
            target_topk_ids=tids[sl], target_topk_probs=tprobs[sl],
            margin=margin[sl], kl=kl[sl], radius={s: v[sl] for s, v in rad.items() if v is not None},
            certified={s: v[sl] for s, v in cert.items() if v is not None},
            draft_rank=None if drank is None else drank[sl], broken=bad[sl],
            roll_ids=None if roll_ids is None else roll_ids[sl],
            roll_logp=None if roll_logp is None else roll_logp[sl],
            roll_gap=None if roll_gap is None else roll_gap[sl],
            roll_mask={s: np.where(bad[sl, None], 0, v[sl]) for s, v in roll_masks.items()}))
    mnt = run.get("max_new_tokens") or (run.get("settings") or {}).get("max_new_tokens")
    if mnt is None:
        mnt = max(len(p) for p in prompts)
        notes.append(f"run.json lacks max_new_tokens: assuming {mnt} (the longest prompt's steps)")
    return ReplayTrace(out_dir, run, list(specs or []), int(mnt), prompts, int(dids.shape[1]), notes, feature,
                       None if roll_ids is None else (int(rollout[0]), int(rollout[1])))


def _is_feature_drafter(spec: str) -> bool:
    """Does the run's drafter spec name a feature (EAGLE-style) drafter?  Those draft deeper
    positions from their own features, which a teacher-forced trace does not record."""
    from ..models.eagle import resolve_spec

    try:
        return resolve_spec(spec) is not None
    except ValueError:
        return False
