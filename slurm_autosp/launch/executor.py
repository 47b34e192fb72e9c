"""The submitit executor for a job: sbatch on a SLURM cluster, local processes elsewhere."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import submitit

from slurm_autosp.config import Backend, ConfigError, JobConfig


def submitit_dir(run_dir: Path) -> Path:
    """Where submitit keeps the pickled job, the per-rank logs and results."""
    return run_dir / "submitit"


def slurm_reachable() -> bool:
    """A controller answers: installed client tools alone do not make a cluster."""
    if shutil.which("sbatch") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def resolve_backend(backend: Backend) -> Backend:
    if backend is Backend.auto:
        return Backend.slurm if slurm_reachable() else Backend.local
    return backend


def build_executor(cfg: JobConfig) -> submitit.AutoExecutor:
    c = cfg.cluster
    cluster = resolve_backend(c.backend).value
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
