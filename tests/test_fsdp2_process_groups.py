"""An FSDP2 engine in a process that had process groups before its own (a job's start check
makes some before training): its parameters are sharded over its own group.

DTensor's sharding caches outlive process groups and take a cached mesh for an equal one (same
ranks), and torch names a process's default group by a counter that a failed start leaves
advanced. Once an earlier engine's group and the current one are named differently, a
parameter carrying the earlier mesh resolves a group name that no longer exists."""

import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from slurm_autosp.config import load_config
from slurm_autosp.engine import build_engine


def fail_to_start_a_group() -> None:
    """A rendezvous on a port another socket holds: torch names the default group (and counts
    it) before the rendezvous fails, and only destroying a default group resets the count."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(dist.DistNetworkError):
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=1,
                timeout=timedelta(seconds=30),
            )
    assert not dist.is_initialized()


def whole_weights_of_an_engine_in_a_new_group(store: Path) -> dict[str, torch.Tensor]:
    """Start a one-rank group, build an FSDP2 engine (its model on the meta device, each shard
    cut from the seeded init) over it, gather its weights, destroy the group."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        cfg = load_config(["cluster.tasks_per_node=1", "parallel.zero_stage=3"])
        torch.manual_seed(0)
        return dict(build_engine(cfg, torch.device("cpu"), zero_stage=3).full_state_dict())
    finally:
        dist.destroy_process_group()


def test_an_fsdp2_engine_after_earlier_process_groups_shards_over_its_own(tmp_path):
    fail_to_start_a_group()
    first = whole_weights_of_an_engine_in_a_new_group(tmp_path / "first")  # group named "1"
    second = whole_weights_of_an_engine_in_a_new_group(tmp_path / "second")  # named "0"
    assert second.keys() == first.keys()
    assert all(torch.equal(second[name], first[name]) for name in first)
