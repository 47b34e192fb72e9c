"""The submitit executor for a job: sbatch on a SLURM cluster, local processes elsewhere."""

from __future__ import annotations

from pathlib import Path

import submitit

from slurm_autosp.config import Backend, ConfigError, JobConfig


def submitit_dir(run_dir: Path) -> Path:
    """Where submitit keeps the pickled job, the per-rank logs and results."""
    return run_dir / "submitit"


def build_executor(cfg: JobConfig) -> submitit.AutoExecutor:
    c = cfg.cluster
    cluster = None if c.backend is Backend.auto else c.backend.value
    if c.backend is Backend.local and c.nodes != 1:
        raise ConfigError(f"cluster.nodes={c.nodes}: the local backend runs on one machine; set cluster.nodes=1")
    executor = submitit.AutoExecutor(folder=submitit_dir(cfg.run.dir), cluster=cluster)
    params = dict(
        name=cfg.run.name,
        nodes=c.nodes,
        tasks_per_node=c.ranks_per_node,
        cpus_per_task=c.cpus_per_task,
        timeout_min=c.time_min,
    )
    if c.uses_gpus:
        params["gpus_per_node"] = c.gpus_per_node
    executor.update_parameters(**params)
    return executor
