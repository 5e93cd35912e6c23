"""Data parallelism for ``draftcert profile`` under torchrun.

Each rank profiles the prompts with index i % world_size == rank and writes
its own shards (``rank{r}-....parquet``); only rank 0 writes run.json (and,
in ``draftcert profile``, the report), after a barrier.  Ranks never exchange tensors: the shared output
directory is the only meeting point, so a single-process run and a torchrun
run produce the same kind of trace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "setup", "barrier", "all_ok", "teardown", "rank_device"]


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # we initialised the process group (and so destroy it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device: str) -> DistInfo:
    """Join the process group torchrun describes (WORLD_SIZE/RANK env), or reuse one
    the caller already initialised.  gloo on CPU, nccl on CUDA."""
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())), False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_available():
        raise ValueError("WORLD_SIZE > 1 but this torch build has no torch.distributed; run without torchrun")
    backend = "nccl" if str(device).startswith("cuda") and torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), True)


def rank_device(device: str, info: DistInfo) -> torch.device:
    """One GPU per rank: a bare "cuda" becomes cuda:LOCAL_RANK under torchrun."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and info.world_size > 1:
        dev = torch.device("cuda", info.local_rank)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} requested but no CUDA GPU is available; pass --device cpu")
        torch.cuda.set_device(dev)
    return dev


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def all_ok(info: DistInfo, ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (so one rank's failure stops all
    ranks at the same point instead of leaving the others waiting in a barrier)."""
    if info.world_size <= 1:
        return ok
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([0 if ok else 1], device=dev)
    dist.all_reduce(t)
    return int(t.item()) == 0


def teardown(info: DistInfo) -> None:
    if info.owns_group:
        dist.destroy_process_group()
