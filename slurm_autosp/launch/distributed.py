"""torch.distributed from the job's environment: submitit knows the hosts, ranks and job id
on SLURM and for local processes alike."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed(use_gpus: bool, timeout_min: float) -> DistContext:
    """Join the job's process group: NCCL (RCCL on ROCm builds) on GPUs, gloo on CPU.

    The rendezvous is the job's first host on a port seeded by the job id (submitit's
    TorchDistributedEnvironment), so every rank of a job, and no other job, meets there.
    """
    from submitit.helpers import TorchDistributedEnvironment

    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    if use_gpus:
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(
        backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(minutes=timeout_min),
        device_id=device if use_gpus else None,
    )
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    return DistContext(
        rank=env.rank, world_size=env.world_size, local_rank=env.local_rank, device=device
    )
