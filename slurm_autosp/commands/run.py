"""python -m slurm_autosp run cfg=CONFIG.yaml [key=value ...] [--force]

One rank of a training job, for sites that submit their own sbatch scripts: `srun` starts it
on every task (see sbatch/train.sbatch). It runs exactly what `slurm_autosp.submit` would
run in each task, reading ranks and hosts from SLURM's environment: the job is planned and
refused when it does not fit, the plan's choices are written into the run's config on the
first start and read back from it on every requeue, and rank 0 takes the run's lock (every
rank exits when it cannot; --force takes a run whose holder cannot be checked).
"""

from __future__ import annotations

import os

from slurm_autosp.admission import Admission, admit
from slurm_autosp.commands.arguments import arguments, config_error, take_flag
from slurm_autosp.config import ConfigError, JobConfig, load_config, with_default_config
from slurm_autosp.launch.job import LockClaim, TrainingJob
from slurm_autosp.lifecycle.run_dir import RunDir


def admit_start(cfg: JobConfig, restarted: bool) -> Admission:
    """Submit's checks, on every rank. A requeued start trains with the choices its first
    start froze into the run's config; a first start plans (the same on every rank), refuses a
    job that does not fit, and freezes."""
    recorded = RunDir(cfg.run.dir).config
    adopted = load_config([f"cfg={recorded}"]) if restarted and recorded.exists() else None
    admission = admit(cfg, recorded=adopted)
    admission.refuse_unless_fits()
    return admission


def main(argv: list[str] | None = None) -> int:
    argv = arguments(argv, __doc__)
    if argv is None:
        return 0
    argv, force = take_flag(argv, "--force")
    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")
    restarted = os.environ.get("SLURM_RESTART_COUNT", "0") != "0"
    try:
        cfg = admit_start(load_config(with_default_config(argv)), restarted).cfg
        TrainingJob(cfg, LockClaim(force=force, record_config=not restarted))()
    except ConfigError as err:
        return config_error(err)
    return 0
