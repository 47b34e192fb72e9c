"""One rank's parallel dimensions: where it sits in the job's SP (Ulysses x ring) x DP layout,
its device and its process groups, in one value built once at job start. Everything a rank
does by its place (which shard of a sequence it keeps, which samples it reads, which group it
talks to) reads it from here, so no two readers can disagree on it. The job-wide
`ParallelLayout` stays the rank-free value that submit derives before any rank exists; its
groups become torch.distributed groups here, as the dimensions of one (dp, ring, ulysses)
device mesh."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from slurm_autosp.cluster.distributed import init_distributed
from slurm_autosp.cluster.layout import LayoutError, ParallelLayout
from slurm_autosp.cluster.placement import layout_for, layout_summary, verify_topology
from slurm_autosp.compat.torch_api import GroupOptions, flatten_mesh, new_group_options
from slurm_autosp.config import JobConfig

log = logging.getLogger(__name__)

MESH_DIMS = ("dp", "ring", "ulysses")


@dataclass(frozen=True)
class ParallelDims:
    """This rank in the job's layout: what the compiler, the training step, evaluation and the
    probe read its rank, sizes, shard and groups from."""

    rank: int
    local_rank: int  # among the ranks of its node: the one that probes the node's GPUs is 0
    device: torch.device
    layout: ParallelLayout
    mesh: DeviceMesh  # the layout's ranks by (dp, ring, ulysses), whose groups are those below
    sp_group: ProcessGroup  # the ranks sharing this rank's sequences
    dp_group: ProcessGroup  # the ranks holding the same shard: the gradient reduction
    # the ranks of this rank's all-to-alls: its SP group's slice inside one NVLink domain (the
    # SP group itself when ring_size is 1)
    ulysses_group: ProcessGroup
    # the same Ulysses position in each of its SP group's Ulysses groups: the ring's key/value
    # blocks pass between them; None when ring_size is 1
    ring_group: ProcessGroup | None

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def sp_size(self) -> int:
        return self.layout.sp_size

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def sp_rank(self) -> int:
        """Which shard of each sequence this rank keeps."""
        return self.layout.sp_rank(self.rank)

    @property
    def dp_rank(self) -> int:
        """Which data-parallel replica this rank is: which samples it reads."""
        return self.layout.dp_rank(self.rank)

    @property
    def ulysses_size(self) -> int:
        return self.layout.ulysses_size

    @property
    def ring_size(self) -> int:
        return self.layout.ring_size

    @property
    def ulysses_rank(self) -> int:
        """Which slice of the heads this rank takes in attention (sp_rank % ulysses_size)."""
        return self.layout.ulysses_rank(self.rank)

    @property
    def ring_rank(self) -> int:
        """Which of the sequence's blocks this rank's attention holds (sp_rank //
        ulysses_size): its ring neighbours hold blocks ring_rank -+ 1 (mod ring_size)."""
        return self.layout.ring_rank(self.rank)


def device_mesh(layout: ParallelLayout, device: torch.device) -> DeviceMesh:
    """`layout`'s ranks as a (dp, ring, ulysses) device mesh over the world this process has
    joined (`ParallelLayout.mesh_ranks`). Every rank calls it: it creates every group of every
    dimension, one NCCL split a dimension once the world's group is bound to a device, each
    with the world's timeout. A dimension that spans the world gets a group of its own rather
    than the world's default one, so an SP all-to-all never waits in the queue of the world's
    collectives (FSDP2's)."""
    if dist.get_world_size() != layout.world_size:
        raise LayoutError(
            f"torch.distributed has world_size {dist.get_world_size()} but the layout was derived "
            f"for {layout.world_size} ranks; derive it from the job's topology"
        )
    return DeviceMesh(
        device.type,
        torch.tensor(layout.mesh_ranks),
        mesh_dim_names=MESH_DIMS,
        backend_override=tuple(_own_group(device) for _ in MESH_DIMS),
    )


def _own_group(device: torch.device) -> tuple[str, GroupOptions]:
    """(backend, options) of a group of its own on the world's backend, with its timeout; new
    options for each group, as torch writes a group's name and ranks into the ones it is given."""
    return dist.get_backend(), new_group_options(device)


def parallel_dims_for(
    layout: ParallelLayout, local_rank: int, device: torch.device
) -> ParallelDims:
    """This rank's dims in `layout`, over the process group it has joined: the one way dims are
    built. The DP, ring and Ulysses groups are the dimensions of the layout's device mesh, the
    SP group its (ring, ulysses) flattening. Every rank of the group calls it (each builds
    every group). With ring_size 1 the Ulysses group is the SP group (no second communicator
    for the same ranks) and there is no ring group."""
    mesh = device_mesh(layout, device)
    ulysses = mesh.get_group("ulysses")
    if layout.ring_size == 1:
        sp, ring = ulysses, None
    else:
        sp = flatten_mesh(mesh["ring", "ulysses"], "sp", _own_group(device)).get_group()
        ring = mesh.get_group("ring")
    return ParallelDims(
        dist.get_rank(), local_rank, device, layout, mesh, sp, mesh.get_group("dp"), ulysses, ring
    )


def build_parallel_dims(cfg: JobConfig, local_rank: int, device: torch.device) -> ParallelDims:
    """This rank's dims in the layout the config gets (layout_for), logged once."""
    layout = layout_for(cfg)
    if layout.cross_domain:
        log.warning(
            "parallel.allow_cross_domain=true: SP all-to-all crosses NVLink domains (slower)"
        )
    if dist.get_rank() == 0:
        log.info("%s", layout_summary(cfg.cluster, layout))
    return parallel_dims_for(layout, local_rank, device)


def contiguous_parallel_dims(sp_size: int, ring_size: int, device: torch.device) -> ParallelDims:
    """This rank's dims over the world it has joined, its SP groups contiguous ranks
    (ParallelLayout.contiguous): verify's world, which has no cluster profile to lay out by."""
    rank = dist.get_rank()
    layout = ParallelLayout.contiguous(dist.get_world_size(), sp_size, ring_size)
    return parallel_dims_for(layout, rank, device)


def init_parallel_dims(cfg: JobConfig, on_join: Callable[[int], None]) -> ParallelDims:
    """Join the job's process group, check the nodes against the cluster profile, then build
    this rank's dims.

    `on_join(rank)` runs on every rank as soon as the group is up, before any node is probed
    or group built: the job claims its run there, so a start it refuses (by raising) goes no
    further. The process group stays up on error: the caller tears it down.
    """
    local_rank, device = init_distributed(cfg.cluster.uses_gpus, cfg.cluster.collective_timeout_min)
    on_join(dist.get_rank())
    verify_topology(cfg.cluster, local_rank)
    return build_parallel_dims(cfg, local_rank, device)
