"""Everything that makes single-device model code run fast and on many devices, applied from
outside the model in one fixed order: compile, then distribution (STYLE).

Processes are started by `torchrun` (any number of processes and nodes); torch.distributed
does every collective (NCCL on GPUs, gloo on CPU). Nothing here is a hand-made all-reduce.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flashdraft.drafter import DFlashDrafter


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def resolve_device(preference: str, local_rank: int = 0) -> torch.device:
    if preference == "auto":
        preference = "cuda" if torch.cuda.is_available() else "cpu"
    if preference == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device = 'cuda' but no CUDA device is visible; use device = 'cpu'")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if preference != "cpu":
        raise ValueError(f"device {preference!r}: use auto, cpu or cuda")
    return torch.device("cpu")


def init_distributed(preference: str) -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK), if any."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(preference, local_rank)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=timedelta(minutes=30),
            device_id=device if device.type == "cuda" else None,
        )
    return DistInfo(rank, world, local_rank, device)


def all_reduce_sum(tensor: Tensor, info: DistInfo) -> Tensor:
    if info.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        dist.destroy_process_group()


def compile_drafter(drafter: DFlashDrafter) -> DFlashDrafter:
    """Compile each decoder layer in place (`Module.compile`), so parameter names, state
    dicts and checkpoints are untouched (no `_orig_mod.` prefixes anywhere)."""
    for layer in drafter.layers:
        layer.compile(dynamic=False)
    drafter.hidden_norm.compile(dynamic=False)
    return drafter


def wrap_drafter(drafter: DFlashDrafter, info: DistInfo, sharding: str) -> nn.Module:
    """Data parallelism for the drafter: DDP (replicas), or FSDP2 (sharded, large drafters).

    Returns the module to call for the forward; the drafter itself stays the object to
    read config from and to checkpoint (FSDP2 shards it in place, DDP wraps it).
    """
    if not info.distributed:
        return drafter
    if sharding == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in drafter.layers:
            fully_shard(layer)
        fully_shard(drafter)
        return drafter
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(drafter, device_ids=device_ids)
