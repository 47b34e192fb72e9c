"""The rendezvous port: clear of the host's outgoing connections, and a clear error when busy.
Each rank's GPU: the one of its local rank, or the only one it sees."""

import socket

import pytest
import torch.distributed as dist

from slurm_autosp.cluster.distributed import (
    RENDEZVOUS_PORTS,
    init_distributed,
    rank_device_index,
    rendezvous_port,
)


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
