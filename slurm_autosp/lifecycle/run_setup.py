"""The run directory a job trains into: its checkpoint directory checked, taken under the run's
lock, then the resolved config recorded, the earlier submissions' kept. Apart from run_dir.py,
which lock.py imports for the lock's file name."""

from __future__ import annotations

from slurm_autosp.config import ConfigError, JobConfig, to_yaml
from slurm_autosp.lifecycle.lock import RunLock, acquire_lock
from slurm_autosp.lifecycle.run_dir import RunDir, checkpoint_dir_problem, keep_previous_config


def prepare_run_dir(cfg: JobConfig, holder: RunLock, *, force: bool = False) -> None:
    """Create the run directory and its checkpoint directory (refused where we cannot write it
    or every user can: before the job waits in the queue, not when it starts), take its lock
    for `holder` (refused while another live job trains the run: nothing of that run is
    touched), then record the config this submission runs with."""
    run_dir = cfg.run.dir
    run = RunDir(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if problem := checkpoint_dir_problem(run.checkpoints):
            raise ConfigError(
                f"run.output_root={cfg.run.output_root}: {problem}; choose a writable run.output_root "
                "on shared storage"
            )
        acquire_lock(run_dir, holder, force=force, what=f"run.name={cfg.run.name}: {run_dir}")
        keep_previous_config(run)
        run.config.write_text(to_yaml(cfg))
    except OSError as err:
        raise ConfigError(
            f"run.output_root={cfg.run.output_root}: cannot write the run directory {run_dir} ({err}); "
            "choose a writable run.output_root on shared storage"
        ) from err
