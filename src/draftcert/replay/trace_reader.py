"""Read a profile trace for replay: per prompt, the columns the replay and explain need.

The format (columns, versions, shards) is ``draftcert.tracefile``'s; this module only picks
the columns replay uses and splits them per prompt.

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

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..models.eagle import resolve_spec
from ..models.loading import EMBEDDED_SPECS, embedded_checkpoint_dir, embedded_gguf_dir
from ..models.pair import PAIR_MODELS, pair_checkpoint_dir, pair_gguf_dir
from ..profile.settings import prompts_sha, resolve_prompts
from ..prompts import encode_prompt
from ..tracefile import (
    TRACE_FORMAT,
    accept_mask_column,
    accepted_column,
    certified_column,
    column_specs,
    has_drafter_columns,
    load_run,
    radius_column,
    read_columns,
    rollout_mask_column,
    run_shards,
    shard_columns,
)

__all__ = ["PromptTrace", "ReplayTrace", "load_replay_trace", "NO_DRAFTER_MESSAGE", "is_feature_drafter",
           "trace_has_drafter", "prompt_token_ids", "load_tokenizer"]

NO_DRAFTER_MESSAGE = (
    "{where} was recorded without a drafter, so it holds no drafter proposals to replay. "
    "Record one with a drafter, e.g. `draftcert profile --drafter default --prompts mt-bench "
    "--out DIR` (any --drafter spec works: self:skip=L, self:quant=B, a path or hub id)"
)

# read when every shard has them (older formats lack some: see the module doc)
_OPTIONAL = ("nonfinite", "draft_nonfinite", "draft_topk_target_logp", "draft_token_target_rank", "draft_topk_probs",
             "rollout_topk_ids", "rollout_topk_target_logp", "rollout_logit_gap")


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
    def steps(self) -> int:
        return sum(len(p) for p in self.prompts)


def trace_has_drafter(out_dir) -> bool:
    """Was the trace in ``out_dir`` recorded with a drafter (so that it can be replayed)?"""
    return has_drafter_columns(shard_columns(run_shards(out_dir)[0]))


def load_replay_trace(out_dir) -> ReplayTrace:
    """Load ``DIR/trace/*.parquet`` and ``DIR/run.json`` for replay (ValueError on bad input)."""
    out_dir = Path(out_dir)
    shards = run_shards(out_dir)
    run = load_run(out_dir)
    specs: list[str] | None = None
    for path in shards:
        names = shard_columns(path)
        if not has_drafter_columns(names):
            raise ValueError(NO_DRAFTER_MESSAGE.format(where=f"the trace in {out_dir}"))
        sp = column_specs(names, "accepted")
        if specs is None:
            specs = sp
        elif sp != specs:
            raise ValueError(f"trace shard {path} has other criteria ({sp}) than the others ({specs}); the directory "
                             "mixes runs: profile into a fresh --out directory")
    want = ["prompt_id", "position", "target_token", "target_margin", "target_topk_ids", "target_topk_probs",
            "draft_topk_ids", "kl_forward"] + [accepted_column(s) for s in specs]
    per = [c for s in specs for c in (certified_column(s), radius_column(s), accept_mask_column(s), rollout_mask_column(s))]
    data = read_columns(shards, want, _OPTIONAL + tuple(per))

    # rows in (prompt id, position) order; prompts sorted by id
    names = sorted(data.prompt_names)
    rank = np.empty(len(names), np.int64)  # code -> index of its id in names
    rank[np.argsort(np.asarray(data.prompt_names, dtype=object), kind="stable")] = np.arange(len(names))
    pid, pos = rank[data["prompt_id"]], data["position"]
    order = np.lexsort((pos, pid))
    pid, pos = pid[order], pos[order]
    n = data.n

    def get(name):
        v = data.get(name)
        return None if v is None else v[order]

    tt = get("target_token")
    dids = get("draft_topk_ids")
    tids = get("target_topk_ids")
    tprobs = get("target_topk_probs")
    margin = get("target_margin")
    kl = get("kl_forward")
    bad = np.zeros(n, bool)
    for name in ("nonfinite", "draft_nonfinite"):
        v = get(name)
        if v is not None:
            bad |= v
    bad |= ~np.isfinite(kl)
    dlogp = get("draft_topk_target_logp")
    dprobs = get("draft_topk_probs")
    drank = get("draft_token_target_rank")
    acc = {s: get(accepted_column(s)) for s in specs}
    cert = {s: get(certified_column(s)) for s in specs}
    rad = {s: get(radius_column(s)) for s in specs}
    masks_everywhere = dlogp is not None  # draftcert-trace/2 and later
    masks = {}
    if masks_everywhere:
        masks = {s: get(accept_mask_column(s)) for s in specs if accept_mask_column(s) in data}
    settings = run.get("settings") or {}
    rollout = settings.get("rollout")
    roll_ids = get("rollout_topk_ids") if rollout else None
    roll_logp = get("rollout_topk_target_logp") if rollout else None
    roll_gap = get("rollout_logit_gap") if rollout else None
    roll_masks = {}
    if roll_ids is not None:
        depth, width = int(rollout[0]), int(rollout[1])
        roll_ids = roll_ids.reshape(n, depth - 1, width)
        roll_logp = roll_logp.reshape(n, depth - 1, width)
        roll_masks = {s: get(rollout_mask_column(s)) for s in specs if rollout_mask_column(s) in data}
    elif rollout:
        raise ValueError(f"trace in {out_dir}: run.json says rollouts were recorded but the shards lack "
                         "rollout_topk_ids; the directory mixes runs: profile into a fresh --out directory")
    notes = []
    dspec = run.get("drafter") or settings.get("drafter")
    feature = bool(rollout) or (isinstance(dspec, str) and is_feature_drafter(dspec))
    if feature and roll_ids is None:
        notes.append(f"drafter {dspec} is a feature drafter and this trace ({run.get('format', 'draftcert-trace/2')}) "
                     "lacks its own rollouts: it scores the drafter on the target's own hidden states at every "
                     "position, while in decoding its drafts at depth >= 2 condition on its own predicted features; "
                     "replay is exact at depth 1 and an estimate deeper, strict rules included. Re-record it with "
                     f"this version of `draftcert profile` ({TRACE_FORMAT}) for exact replay at every depth")
    if not masks_everywhere:
        notes.append("trace format draftcert-trace/1 (no accept_mask/<spec>): relaxed rules are replayed as chains "
                     "only; re-record with this version of `draftcert profile` to replay them on trees")
    # split per prompt
    prompts = []
    bounds = np.flatnonzero(np.r_[True, pid[1:] != pid[:-1], True])
    for a, b in zip(bounds[:-1], bounds[1:]):
        p = names[int(pid[a])]
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


def _local_tokenizer_dirs(spec) -> list[Path]:
    """The cache folders that may hold a GGUF-sourced target's tokenizer, the run's default first: the
    GGUF folder (``weights="gguf"``, the default, which writes no float32 checkpoint) and the converted
    float32 checkpoint (``weights="float32"``).  Both hold the tokenizer parsed from the same GGUF."""
    if spec in EMBEDDED_SPECS:
        return [embedded_gguf_dir(), embedded_checkpoint_dir()]
    if spec in PAIR_MODELS:
        return [pair_gguf_dir(spec), pair_checkpoint_dir(spec)]
    return []


def load_tokenizer(run: dict):
    """The target's tokenizer from run.json's target spec, if it is available offline; else None.
    The embedded target and the pair's models: from whichever of their cache folders exists (the GGUF
    folder, or the float32 checkpoint); another spec: a local folder or the local Hugging Face cache."""
    spec = run.get("target")
    try:
        from transformers import AutoTokenizer  # optional: models extra

        if spec is None or spec in EMBEDDED_SPECS or spec in PAIR_MODELS:
            for d in _local_tokenizer_dirs(spec):
                if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file():
                    return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
            return None
        if isinstance(spec, str) and not spec.startswith("object:"):
            return AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except Exception:
        return None
    return None


def prompt_token_ids(trace: ReplayTrace, tokenizer) -> list[tuple[str, list[int]]]:
    """Every prompt of the trace as (id, token ids), in the order ``draftcert profile`` read them (the
    order of its prompt source: the order a decode of them in turn follows), encoded as the profile
    encoded them (``prompts.encode_prompt`` with the run's tokenizer).

    The trace holds the generated tokens, not the prompts': they are read again from run.json's
    prompt source (a prompt set or file; not prompts passed inline to ``profile()``) and checked
    against its ``prompts_sha256``.  ValueError saying what is missing."""
    run = trace.run
    settings = run.get("settings") or {}
    source = settings.get("prompts", run.get("prompts"))
    if not source or source == "inline":
        raise ValueError("the run's prompts were passed inline to profile(), so they cannot be read again; pass "
                         "prompts=[(id, token ids), ...] in decode order")
    if tokenizer is None:
        raise ValueError(f"the run's tokenizer ({run.get('target')}) is not available offline")
    try:
        plist, _ = resolve_prompts(source, settings.get("limit", run.get("limit")))
    except (OSError, ValueError, RuntimeError) as exc:
        raise ValueError(f"the run's prompts ({source}) cannot be read again: {exc}") from None
    sha = settings.get("prompts_sha256")
    n = settings.get("n_prompts", len(plist))
    if sha is not None and prompts_sha(plist[:n]) != sha:
        raise ValueError(f"the prompts of {source} are not those profiled (prompts_sha256 differs)")
    want = {p.id for p in trace.prompts}
    out = [(p.id, list(encode_prompt(tokenizer, p.text))) for p in plist if p.id in want]
    if len(out) != len(want):
        raise ValueError(f"{len(want) - len(out)} traced prompt(s) are not in {source}")
    return out


def is_feature_drafter(spec: str) -> bool:
    """Does the run's drafter spec name a feature (EAGLE-style) drafter?  Those draft deeper
    positions from their own features, which a teacher-forced trace does not record."""
    try:
        return resolve_spec(spec) is not None
    except ValueError:
        return False
