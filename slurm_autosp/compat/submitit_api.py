"""submitit's private names that slurm_autosp uses (no torch here: status and submit's
rendering stay light)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import pickle_load as _pickle_load


def requeue(job_env: submitit.JobEnvironment, countdown: int) -> None:
    """submitit's per-backend requeue of the running job (scontrol on SLURM, the local
    controller's exit code otherwise), allowing `countdown` more requeues."""
    job_env._requeue(countdown)


def slurm_parameters(executor: submitit.SlurmExecutor, shared: dict[str, Any]) -> dict[str, Any]:
    """AutoExecutor's shared parameters (timeout_min, nodes, ...) as SlurmExecutor's own."""
    return executor._convert_parameters(shared)


def sbatch_text(executor: submitit.SlurmExecutor, uid: str) -> str:
    """The script submitit would hand to sbatch for one job of `executor`."""
    return executor._make_submission_file_text(executor._submitit_command_str, uid=uid)


def show_local_gpus(executor: submitit.AutoExecutor, gpus: tuple[int, ...]) -> None:
    """The GPUs (by index) a local job's ranks see: LocalExecutor's `visible_gpus`, which
    AutoExecutor does not pass through."""
    executor._executor.update_parameters(visible_gpus=gpus)


def pickle_load(path: str | Path) -> Any:
    """A submitit result pickle: (outcome, payload)."""
    return _pickle_load(path)
