"""Submitting a checked config: the dry run's description, or the run taken for the job, the
job queued (sbatch or local processes) and the run's lock handed to it, then followed or not.
What the submit command does after loading a config, and what the probe does with its own."""

from __future__ import annotations

import os
import socket

from slurm_autosp.admission import admit
from slurm_autosp.cluster.layout import ParallelLayout
from slurm_autosp.cluster.placement import layout_summary
from slurm_autosp.config import Backend, JobConfig, to_yaml
from slurm_autosp.launch.executor import build_executor, resolve_backend, sbatch_script
from slurm_autosp.launch.job import LockClaim, TrainingJob, collective_env_for
from slurm_autosp.launch.watch import follow, next_steps
from slurm_autosp.lifecycle.lock import SUBMITTING, RunLock, acquire_lock, release_lock
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.lifecycle.run_setup import prepare_run_dir


def describe_dry_run(cfg: JobConfig, backend: Backend, layout: ParallelLayout) -> str:
    """What would run, where and how: the script, the config, the layout and the environment;
    it needs no Slurm, so a cluster job can be planned anywhere."""
    c = cfg.cluster
    env = collective_env_for(cfg, inherited={})
    if backend is Backend.slurm:
        launch = "# sbatch script (submitit would submit exactly this)\n" + sbatch_script(cfg)
    else:
        launch = (
            f"# local: {c.world_size} processes on this machine through submitit's local executor"
        )
    return "\n".join(
        [
            launch,
            "# resolved config",
            to_yaml(cfg).rstrip(),
            "# parallel layout",
            layout_summary(cfg.cluster, layout),
            repr(layout),
            "# environment set on every rank before torch.distributed starts",
            *(f"{k}={v}" for k, v in sorted(env.items())),
            f"# dry run: nothing submitted ({c.world_size} ranks, backend {backend.value})",
        ]
    )


def submit(cfg: JobConfig, force: bool, job_type: type[TrainingJob] = TrainingJob) -> int:
    """Admit (every check before queueing, see `slurm_autosp.admission`) and submit a loaded
    config: what `main` does after loading it, and what the probe does with its own config
    (an object, so no value is re-read as text). Refusals raise ConfigError, before anything
    is queued or written; the command prints them."""
    submission = RunLock(str(os.getpid()), SUBMITTING, socket.gethostname())
    admission = admit(cfg, saves_checkpoints=job_type.saves_checkpoints)
    cfg, layout = admission.cfg, admission.layout
    backend = resolve_backend(cfg.cluster.backend)
    if cfg.dry_run:  # the plan is printed even when the job does not fit
        print(describe_dry_run(cfg, backend, layout))
        print(admission.plan.text)
        return 0
    executor = build_executor(cfg, backend)
    admission.refuse_unless_fits()
    prepare_run_dir(cfg, submission, force=force)
    try:
        job = executor.submit(job_type(cfg, LockClaim(handed_over_by=submission)))
    except BaseException:
        release_lock(cfg.run.dir, submission)
        raise
    acquire_lock(  # the lock now names the job, which holds it from its start
        cfg.run.dir,
        RunLock(job.job_id, executor.cluster, submission.host),
        handed_over_by=submission,
    )
    print(
        f"submitted job {job.job_id} ({executor.cluster}, {cfg.cluster.world_size} ranks, {layout!r}); "
        f"run directory {cfg.run.dir}; per-rank logs in {RunDir(cfg.run.dir).submitit}",
        flush=True,
    )
    if cfg.follow is False or (cfg.follow is None and backend is Backend.slurm):
        print(next_steps(job, cfg.run.dir))
        return 0
    return follow(job, cfg.run.dir)
