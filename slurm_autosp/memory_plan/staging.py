"""Whether a node's host memory can stage asynchronous saves (checkpoint/async_save.py) beside
what the plan already keeps there (offloaded activations and optimizer state).

An asynchronous save is first copied whole to node memory: every rank's fp32 master weights
and Adam moments (12 bytes per parameter over the world), and, under ZeRO-1, rank 0's copy of
the model's weights. Its staging buffers stay allocated from save to save, so the plan counts
them at full size; under FSDP2 twice, since its distributed checkpoint is written from the
buffer into node memory before the writer copies it out. Where it does not fit, saves are synchronous, said in the plan."""

from __future__ import annotations

from dataclasses import dataclass

from slurm_autosp.lifecycle.save_time import rank0_checkpoint_bytes
from slurm_autosp.memory_plan.terms import GB, MemoryPlan


@dataclass(frozen=True)
class Staging:
    asynchronous: bool  # what training runs with
    requested: bool  # checkpoint.async_save is not false
    node_bytes: float  # what a save stages on the node with rank 0
    room_bytes: float  # the node's usable host memory the plan leaves free

    def line(self) -> str:
        figures = (
            f"{self.node_bytes / GB:,.1f} GB staged per node, {self.room_bytes / GB:,.0f} GB of "
            "host memory free beside the plan's offload"
        )
        if not self.requested:
            return "checkpoint saves: synchronous (checkpoint.async_save=false)"
        if self.asynchronous:
            return f"checkpoint saves: asynchronous ({figures})"
        return (
            f"checkpoint saves: synchronous, host memory cannot stage them ({figures}); raise "
            "cluster.host_memory_gb if the nodes have more"
        )


def checkpoint_staging(plan: MemoryPlan) -> Staging:
    cfg, memory = plan.cfg, plan.configured
    ranks = cfg.cluster.ranks_per_node
    rank0 = rank0_checkpoint_bytes(cfg, plan.trained, plan.zero_stage)
    other = rank0_checkpoint_bytes(cfg, plan.trained, 3)  # an optimizer shard, no weights
    copies = 2 if plan.zero_stage == 3 else 1
    node = copies * (rank0 + (ranks - 1) * other)
    room = (memory.host_bytes_per_rank - memory.host_bytes) * ranks
    requested = cfg.checkpoint.async_save is not False
    return Staging(requested and node <= room, requested, node, room)
