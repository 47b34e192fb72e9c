"""torch.distributed from the job's environment: submitit knows the hosts, ranks and job id
on SLURM and for local processes alike."""

from __future__ import annotations

import datetime
import os
import zlib

import torch
import torch.distributed as dist
from submitit import JobEnvironment
from submitit.helpers import TorchDistributedEnvironment

from slurm_autosp.config import is_user_port

# Below Linux's default ephemeral range (net.ipv4.ip_local_port_range, 32768-60999), so no
# outgoing connection on the host (gloo's pairs, NFS, another job's store clients) can hold it.
RENDEZVOUS_PORTS = range(20000, 32768)


def init_distributed(use_gpus: bool, timeout_min: float) -> tuple[int, torch.device]:
    """Join the job's process group: NCCL (RCCL on ROCm builds) on GPUs, gloo on CPU; return
    this rank's node-local rank and device (its rank is torch.distributed's from here on).

    The rendezvous is the job's first host on `rendezvous_port`, so every rank of a job, and
    no other job, meets there.
    """
    env, device = export_rank_environment(torch.cuda.device_count() if use_gpus else None)
    if use_gpus:
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(
            "nccl" if use_gpus else "gloo",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(minutes=timeout_min),
            device_id=device if use_gpus else None,
        )
    except dist.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        raise RuntimeError(
            f"rank {env.rank}: the rendezvous port {env.master_port} on {env.master_addr} is "
            "already in use by another process; set cluster.env.MASTER_PORT to a free port "
            f"(e.g. one in {RENDEZVOUS_PORTS.start}-{RENDEZVOUS_PORTS.stop - 1}) and resubmit"
        ) from e
    return env.local_rank, device


def export_rank_environment(
    gpus_visible: int | None,
) -> tuple[TorchDistributedEnvironment, torch.device]:
    """This rank's place in the job, from submitit (on SLURM and for local processes alike),
    exported for torch.distributed, and its device, decided once: the GPU rank_device_index
    picks among `gpus_visible` (None: a CPU rank).

    LOCAL_RANK is set to that GPU's index, not left the node-local rank submitit exports:
    DeepSpeed's engine takes LOCAL_RANK for its device (set_device(LOCAL_RANK) and
    cuda:LOCAL_RANK), as does torch's DeviceMesh where no device is set: local rank 3 shown
    only its own GPU would ask for cuda:3, which it does not have. The node-local rank stays in
    the returned environment, for what needs it (which rank of a node probes the node's GPUs).
    """
    os.environ["MASTER_PORT"] = str(rendezvous_port(JobEnvironment().job_id))
    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    if gpus_visible is None:
        return env, torch.device("cpu")
    index = rank_device_index(env.local_rank, env.local_world_size, gpus_visible)
    os.environ["LOCAL_RANK"] = str(index)
    return env, torch.device("cuda", index)


def rank_device_index(local_rank: int, local_world_size: int, visible: int) -> int:
    """The index, among the GPUs this rank sees, of its own. Slurm may show each task all of
    its node's GPUs (--gpus-per-node: the rank takes the one of its local rank) or only its own
    (--gpus-per-task=1, --gpu-bind=single:1, or a site's cgroup: device 0 is the rank's)."""
    if visible == 1:
        return 0
    if visible >= local_world_size:
        return local_rank
    shown = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    raise RuntimeError(
        f"local rank {local_rank} of {local_world_size} on this node sees {visible} GPUs "
        f"(CUDA_VISIBLE_DEVICES={shown}): each rank needs its own GPU, either all of the node's "
        "visible to every rank or exactly one per rank; set cluster.gpus_per_node to the GPUs "
        "the node gives the job and cluster.tasks_per_node to match"
    )


def rendezvous_port(job_id: str) -> int:
    """MASTER_PORT if the job's environment sets it (cluster.env, or the submitting shell), else
    a port in RENDEZVOUS_PORTS seeded by the job id.

    submitit's own choice (20000-60000) mostly falls in the ephemeral range, where a busy
    node's outgoing connections could already hold it (EADDRINUSE at start-up, seen with two
    jobs sharing a node); a requeued job keeps its id and so its port.
    """
    if "MASTER_PORT" in os.environ:
        port = os.environ["MASTER_PORT"]
        if not is_user_port(port):
            raise RuntimeError(
                f"MASTER_PORT={port!r} in the job's environment is not a port number; set "
                "cluster.env.MASTER_PORT to a free port, or unset it to derive one from the job id"
            )
        return int(port)
    return RENDEZVOUS_PORTS[zlib.crc32(job_id.encode()) % len(RENDEZVOUS_PORTS)]
