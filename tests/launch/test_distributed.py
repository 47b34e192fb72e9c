"""The rendezvous port: clear of the host's outgoing connections, and a clear error when busy."""

import socket

import pytest
import torch.distributed as dist

from slurm_autosp.launch.distributed import RENDEZVOUS_PORTS, init_distributed, rendezvous_port


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
