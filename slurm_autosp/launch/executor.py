"""The submitit executor for a job: sbatch on a SLURM cluster, local processes elsewhere."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import submitit

from typing import Any, Dict

from slurm_autosp.config import Backend, ClusterConfig, JobConfig


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
    if c.mem_gb is not None:
        params["mem_gb"] = c.mem_gb
    executor.update_parameters(**params, **_slurm_parameters(c))
    return executor


def _slurm_parameters(c: ClusterConfig) -> Dict[str, Any]:
    """The SLURM-only options (submitit ignores them on the local executor)."""
    srun_args = list(c.srun_args)
    if c.container_image:
        srun_args.append(f"--container-image={c.container_image}")
    if c.container_mounts:
        srun_args.append(f"--container-mounts={','.join(c.container_mounts)}")
    optional = {
        "slurm_partition": c.partition,
        "slurm_account": c.account,
        "slurm_qos": c.qos,
        "slurm_constraint": c.constraint,
        "slurm_exclusive": c.exclusive or None,
    }
    return {
        **{k: v for k, v in optional.items() if v is not None},
        "slurm_signal_delay_s": c.signal_delay_s,
        "slurm_setup": list(c.setup),
        "slurm_srun_args": srun_args,
        "slurm_additional_parameters": {"requeue": True, **c.sbatch_extra},
    }


def sbatch_script(executor: submitit.AutoExecutor) -> str:
    """The exact script submitit would hand to sbatch (a dry run prints it)."""
    slurm = executor._executor  # submitit renders the script only on its SLURM executor
    return slurm._make_submission_file_text(slurm._submitit_command_str, uid="dry-run")
