"""The private APIs of submitit and torch that slurm_autosp relies on, in one place.

Each is a name upstream may rename or remove in any release; tests/test_compat.py checks every
one against the installed versions, so an upgrade that breaks one fails there, by name, rather
than deep inside a job. Code elsewhere calls these wrappers instead of the private names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import pickle_load as _pickle_load
from torch._inductor.runtime import cache_dir_utils as _inductor_cache_dir_utils

# --------------------------------------------------------------------------------- submitit


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


def pickle_load(path: str | Path) -> Any:
    """A submitit result pickle: (outcome, payload)."""
    return _pickle_load(path)


# ------------------------------------------------------------------------------------ torch


def inductor_default_cache_dir() -> str:
    """Inductor's cache directory when TORCHINDUCTOR_CACHE_DIR is unset; importing
    torch._dynamo exports it as TORCHINDUCTOR_CACHE_DIR."""
    return os.path.abspath(_inductor_cache_dir_utils.default_cache_dir())
