"""The run directory a job trains into: its checkpoint directory checked, taken under the run's
lock, then the resolved config recorded, the earlier submissions' kept."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from slurm_autosp.config import ConfigError, JobConfig, to_yaml
from slurm_autosp.lifecycle.lock import RunLock, acquire_lock
from slurm_autosp.lifecycle.save_schedule import checkpoint_dir

log = logging.getLogger(__name__)


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


def checkpoint_dir_problem(root: Path) -> str:
    """Why `root` cannot hold this run's checkpoints ("" if it can): it must be a directory we
    can write, and one other users cannot, since resuming unpickles what DeepSpeed and DCP
    wrote there. A directory the group can write (teams share runs that way) is warned about."""
    probe = root / f".write-probe-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        return f"checkpoint directory {root} is not writable ({err.strerror or err})"
    mode = root.stat().st_mode
    if mode & stat.S_IWOTH:
        return (
            f"checkpoint directory {root} is writable by every user, and resuming loads files from it; "
            f"chmod o-w {root}"
        )
    if mode & stat.S_IWGRP:
        log.warning(
            "checkpoint directory %s is writable by its group: anyone in it can change what a resume loads",
            root,
        )
    return ""
