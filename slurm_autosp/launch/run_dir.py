"""The run directory a job trains into: its checkpoint directory checked, taken under the run's
lock, then the resolved config recorded, the earlier submissions' kept."""

from __future__ import annotations

from pathlib import Path

from slurm_autosp.checkpoint.lock import RunLock, acquire_lock
from slurm_autosp.checkpoint.schedule import checkpoint_dir
from slurm_autosp.checkpoint.store import checkpoint_dir_problem
from slurm_autosp.config import ConfigError, JobConfig, to_yaml


def prepare_run_dir(cfg: JobConfig, holder: RunLock, *, force: bool = False) -> None:
    """Create the run directory and its checkpoint directory (refused where we cannot write it
    or every user can: before the job waits in the queue, not when it starts), take its lock
    for `holder` (refused while another live job trains the run: nothing of that run is
    touched), then record the config this submission runs with."""
    run_dir = cfg.run.dir
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if problem := checkpoint_dir_problem(checkpoint_dir(run_dir)):
            raise ConfigError(
                f"run.output_root={cfg.run.output_root}: {problem}; choose a writable run.output_root "
                "on shared storage"
            )
        acquire_lock(run_dir, holder, force=force, what=f"run.name={cfg.run.name}: {run_dir}")
        _keep_previous_config(run_dir)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    except OSError as err:
        raise ConfigError(
            f"run.output_root={cfg.run.output_root}: cannot write the run directory {run_dir} ({err}); "
            "choose a writable run.output_root on shared storage"
        ) from err


def _keep_previous_config(run_dir: Path) -> None:
    """A resubmission may change settings a checkpoint allows to change: the config each earlier
    submission ran with stays as configs/config.NNNN.yaml (in submission order), never overwritten."""
    previous = run_dir / "config.yaml"
    if not previous.exists():
        return
    kept = run_dir / "configs"
    kept.mkdir(exist_ok=True)
    number = len(list(kept.glob("config.*.yaml"))) + 1
    while True:
        try:
            with open(kept / f"config.{number:04d}.yaml", "x") as f:
                f.write(previous.read_text())
            return
        except FileExistsError:
            number += 1
