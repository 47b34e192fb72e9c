"""The rendezvous port: clear of the host's outgoing connections, and a clear error when busy.
Each rank's GPU: the one of its local rank, or the only one it sees, and the one DeepSpeed
takes."""

import os
import socket

import deepspeed
import pytest
import torch
import torch.distributed as dist
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
from deepspeed.comm.utils import get_local_rank_from_launcher
from deepspeed.utils import groups

from slurm_autosp.cluster.distributed import (
    RENDEZVOUS_PORTS,
    export_rank_environment,
    init_distributed,
    rank_device_index,
    rendezvous_port,
)
from slurm_autosp.compat.deepspeed_api import skip_shared_memory_comm_build


def _ephemeral_ports() -> range:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(p) for p in f.read().split())
    return range(low, high + 1)


def test_the_derived_port_is_below_the_ephemeral_range_and_fixed_per_job(monkeypatch):
    """submitit's seeded port fell in the ephemeral range: one job's start failed with
    EADDRINUSE while another job's gloo connections held that port as their local end."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    ports = {job_id: rendezvous_port(job_id) for job_id in ["67", "67_0", "1234567", "98765"]}
    assert all(p in RENDEZVOUS_PORTS and p not in _ephemeral_ports() for p in ports.values())
    assert len(set(ports.values())) == len(ports)
    assert rendezvous_port("67") == ports["67"]  # a requeued job meets on the same port


def test_master_port_in_the_job_environment_wins(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert rendezvous_port("67") == 29500
    monkeypatch.setenv("MASTER_PORT", "twenty")
    with pytest.raises(RuntimeError, match=r"MASTER_PORT='twenty' .* is not a port number"):
        rendezvous_port("67")


def test_a_busy_rendezvous_port_names_the_port_and_the_setting_to_change(monkeypatch, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for name, value in {
            "SUBMITIT_EXECUTOR": "local",
            "SUBMITIT_FOLDER": str(tmp_path),
            "SUBMITIT_LOCAL_JOB_ID": "4242",
            "SUBMITIT_LOCAL_NTASKS": "1",
            "MASTER_PORT": str(port),
        }.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(
            RuntimeError, match=rf"rendezvous port {port} .* cluster\.env\.MASTER_PORT"
        ):
            init_distributed(use_gpus=False, timeout_min=0.5)
    assert not dist.is_initialized()


def test_a_rank_that_sees_only_its_own_gpu_takes_device_0():
    """Slurm's --gpus-per-task=1 (or a site's cgroups) shows each task one GPU: cuda:3 would not
    exist for local rank 3."""
    assert [rank_device_index(r, 4, visible=1) for r in range(4)] == [0, 0, 0, 0]


def test_ranks_that_see_the_whole_node_take_the_gpu_of_their_local_rank():
    assert [rank_device_index(r, 4, visible=4) for r in range(4)] == [0, 1, 2, 3]
    assert [rank_device_index(r, 2, visible=8) for r in range(2)] == [0, 1]


def test_a_rank_without_a_gpu_of_its_own_is_refused_naming_what_it_sees(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(
        RuntimeError, match=r"local rank 3 of 4 .* sees 2 GPUs \(CUDA_VISIBLE_DEVICES=0,1\)"
    ):
        rank_device_index(3, 4, visible=2)
    with pytest.raises(RuntimeError, match="sees 0 GPUs"):
        rank_device_index(0, 1, visible=0)


# The fourth of eight tasks on one node, as Slurm describes it to the task (submitit reads it).
TASK_3_OF_8 = {
    "SUBMITIT_EXECUTOR": "slurm",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_JOB_NODELIST": "gpu-node1",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "3",
}


@pytest.fixture()
def task_3_of_8(tmp_path):
    """This process as that task, in a one-rank gloo group of its own (DeepSpeed's engine needs
    one); the environment is put back after, and DeepSpeed forgets the group."""
    saved = dict(os.environ)
    os.environ.update(TASK_3_OF_8)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    groups._WORLD_GROUP = None
    try:
        yield
    finally:
        dist.destroy_process_group()
        groups._WORLD_GROUP = None
        os.environ.clear()
        os.environ.update(saved)


def test_deepspeed_takes_the_one_gpu_a_task_sees_as_its_device(task_3_of_8):
    """--gpus-per-task=1: local rank 3 sees one GPU and runs on cuda:0. DeepSpeed's engine
    takes LOCAL_RANK for its device (set_device(LOCAL_RANK), cuda:LOCAL_RANK): it must read 0,
    not the node-local 3 (an invalid device ordinal). The node-local rank is still the rank's,
    for choosing the rank that probes the node. A real engine, built on CPU, reads it; the CUDA
    accelerator names the device it would take (no GPU here to take it)."""
    env, device = export_rank_environment(gpus_visible=1)
    assert (env.local_rank, device) == (3, torch.device("cuda", 0))
    skip_shared_memory_comm_build()
    engine, *_ = deepspeed.initialize(
        model=torch.nn.Linear(2, 2), config={"train_batch_size": 1, "steps_per_print": 2**62}
    )
    assert engine.local_rank == deepspeed.comm.get_local_rank() == 0
    assert CUDA_Accelerator().device(engine.local_rank) == device


def test_ranks_that_see_the_whole_node_tell_deepspeed_their_local_rank(task_3_of_8):
    env, device = export_rank_environment(gpus_visible=8)
    assert (env.local_rank, device) == (3, torch.device("cuda", 3))
    assert get_local_rank_from_launcher() == 3  # what deepspeed.comm.get_local_rank returns


def test_cpu_ranks_keep_their_node_local_rank(task_3_of_8):
    env, device = export_rank_environment(gpus_visible=None)
    assert (env.local_rank, device, os.environ["LOCAL_RANK"]) == (3, torch.device("cpu"), "3")
