"""A local job's ranks see the GPUs the submitting shell shows them, not GPUs 0..n-1: submitit's
local executor would otherwise override CUDA_VISIBLE_DEVICES, and a job meant for GPUs 4 and 5
would train on another user's 0 and 1."""

import os

import pytest

from slurm_autosp.config import Backend, ConfigError, load_config
from slurm_autosp.launch.executor import build_executor, local_gpus


def gpu_cluster(tmp_path, gpus=2):
    return load_config(
        [
            f"run.output_root={tmp_path}",
            "run.name=gpus",
            f"cluster.gpus_per_node={gpus}",
            "cluster.backend=local",
            "cluster.time_min=2",
        ]
    )


def test_the_gpus_the_shell_shows_are_the_jobs_in_their_order(tmp_path):
    cluster = gpu_cluster(tmp_path).cluster
    assert local_gpus(cluster, {"CUDA_VISIBLE_DEVICES": "6,4,5"}) == (6, 4)
    assert local_gpus(cluster, {}) == (0, 1)


def test_gpus_named_otherwise_than_by_index_or_too_few_are_refused_by_name(tmp_path):
    cluster = gpu_cluster(tmp_path).cluster
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=GPU-8f2e.*by index"):
        local_gpus(cluster, {"CUDA_VISIBLE_DEVICES": "GPU-8f2e,GPU-11aa"})
    with pytest.raises(
        ConfigError, match=r"cluster.gpus_per_node=2 but CUDA_VISIBLE_DEVICES=3 shows 1"
    ):
        local_gpus(cluster, {"CUDA_VISIBLE_DEVICES": "3"})
    with pytest.raises(ConfigError, match="shows 0 GPU"):
        local_gpus(cluster, {"CUDA_VISIBLE_DEVICES": ""})


def test_a_local_job_runs_with_the_gpus_the_shell_showed(tmp_path, monkeypatch):
    """A real submitit local job reports the CUDA_VISIBLE_DEVICES its ranks start with."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    cfg = gpu_cluster(tmp_path)
    cfg.run.dir.mkdir(parents=True)
    job = build_executor(cfg, Backend.local).submit(os.getenv, "CUDA_VISIBLE_DEVICES")
    assert job.results() == ["4,5", "4,5"]  # both ranks
