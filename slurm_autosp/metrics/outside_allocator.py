"""GPU memory torch's allocator never sees: the CUDA context, NCCL's buffers, other libraries'
own allocations. Before a job runs the memory plan can only estimate it: NCCL sizes its buffers
per communicator, per peer and per algorithm, lazily, at the first collective of each kind
(NVLS and all-to-all buffers commonly take a GB or more). After a job's first step every
collective of training has run, so each rank reads it as the device's used memory minus what
torch's allocator has reserved, and rank 0 records the largest in the run directory; the next
plan of the run counts that instead of its estimate (memory_plan.terms.outside_allocator).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from slurm_autosp.cluster.parallel_dims import ParallelDims
from slurm_autosp.lifecycle.run_record import read_record, write_record


@dataclass(frozen=True)
class OutsideAllocator:
    """Bytes outside torch's allocator on a job's busiest GPU, with the layout it ran (its
    communicators, and NCCL's buffers in them, follow from the layout)."""

    bytes: float  # the largest over the ranks
    world_size: int
    sp_size: int
    ring_size: int
    zero_stage: int  # the engine: DeepSpeed (1) builds communicators of its own, FSDP2 (3) not
    device: str  # the GPU's name, as torch reports it
    step: int  # read after this step, the job's first

    def matches(self, world_size: int, sp_size: int, ring_size: int, zero_stage: int) -> bool:
        return (self.world_size, self.sp_size, self.ring_size, self.zero_stage) == (
            world_size,
            sp_size,
            ring_size,
            zero_stage,
        )

    def write(self, path: Path) -> None:
        write_record(self, path)

    @classmethod
    def read(cls, path: Path) -> OutsideAllocator | None:
        return read_record(
            cls,
            path,
            "memory outside torch's allocator",
            lambda r: (
                r.bytes >= 0
                and min(r.world_size, r.sp_size, r.ring_size) > 0
                and r.zero_stage in (1, 3)
            ),
        )


def used_outside_allocator(device: torch.device) -> float | None:
    """This rank's device memory in use that torch's allocator has not reserved; None off GPUs
    (a CPU rank's memory is one resident set). One rank per GPU: another process's memory on
    the same device would count here."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return float(total - free - torch.cuda.memory_reserved(device))


def record_outside_allocator(path: Path, dims: ParallelDims, zero_stage: int, step: int) -> None:
    """Every rank, after the job's first step: the largest reading over the ranks, recorded by
    rank 0. Nothing on CPU ranks."""
    local = used_outside_allocator(dims.device)
    if local is None:
        return
    largest = torch.tensor([local], dtype=torch.float64, device=dims.device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    if dims.rank == 0:
        layout = dims.layout
        OutsideAllocator(
            largest.item(),
            layout.world_size,
            layout.sp_size,
            layout.ring_size,
            zero_stage,
            torch.cuda.get_device_name(dims.device),
            step,
        ).write(path)
