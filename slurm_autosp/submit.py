"""python -m slurm_autosp.submit cfg=CONFIG.yaml [key=value ...]

Submit a training job: sbatch on a SLURM cluster, local processes elsewhere. Without
cfg=, the embedded default trains a tiny Llama on 2 local CPU ranks. The memory plan's
choices (ZeRO stage, checkpointing, tiling, offload) are written into the run's config: every
start and requeue of the job trains with them.

  python -m slurm_autosp.submit cfg=configs/tiny_cpu.yaml train.steps=50
  python -m slurm_autosp.submit cfg=configs/llama70b_128k.yaml cluster.nodes=8 dry_run=true

On SLURM, submit returns once the job is queued and prints how to follow it (follow=true
streams rank 0's log instead; Ctrl-C then detaches, the job runs on); local jobs are followed
until they end (Ctrl-C cancels them).

One job trains a run at a time: a run held by a live job is refused. --force takes over a run
whose job cannot be checked (the SLURM controller does not answer), once you know it is gone.

Every key of the config can be overridden as section.key=value (e.g. parallel.sp_size=4,
cluster.backend=local). The run's directory <run.output_root>/<run.name>/ receives the
resolved config (config.yaml; earlier submissions' in configs/), per-rank logs, checkpoints
and TensorBoard events:

  tensorboard --logdir <run.output_root>/<run.name>/tensorboard
"""

from __future__ import annotations

import os
import socket
import sys

from slurm_autosp.checkpoint.identity import run_settings
from slurm_autosp.checkpoint.lock import SUBMITTING, RunLock, acquire_lock, release_lock
from slurm_autosp.checkpoint.schedule import checkpoint_dir
from slurm_autosp.checkpoint.store import refuse_another_runs_checkpoint
from slurm_autosp.cli import arguments, config_error, take_flag
from slurm_autosp.config import Backend, ConfigError, JobConfig, load_config, to_yaml
from slurm_autosp.data import check_token_file
from slurm_autosp.job import LockClaim, TrainingJob, collective_env_for
from slurm_autosp.launch.executor import (
    build_executor,
    resolve_backend,
    sbatch_script,
    submitit_dir,
)
from slurm_autosp.launch.layout import ParallelLayout
from slurm_autosp.launch.placement import plan_layout
from slurm_autosp.launch.run_dir import prepare_run_dir
from slurm_autosp.launch.watch import follow, next_steps
from slurm_autosp.model import model_vocab_size, refuse_unsupported_attention
from slurm_autosp.plan import plan_verdict
from slurm_autosp.plan.freeze import freeze_choices


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
            repr(layout),
            "# environment set on every rank before torch.distributed starts",
            *(f"{k}={v}" for k, v in sorted(env.items())),
            f"# dry run: nothing submitted ({c.world_size} ranks, backend {backend.value})",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = arguments(argv, __doc__)
    if argv is None:
        return 0
    argv, force = take_flag(argv, "--force")
    try:
        cfg = load_config(argv)
    except ConfigError as err:
        return config_error(err)
    return submit(cfg, force)


def submit(cfg: JobConfig, force: bool, job_type: type[TrainingJob] = TrainingJob) -> int:
    """Check, plan and submit a loaded config: what `main` does after loading it, and what the
    probe does with its own config (an object, so no value is re-read as text)."""
    submission = RunLock(str(os.getpid()), SUBMITTING, socket.gethostname())
    try:
        refuse_unsupported_attention(cfg)
        check_token_file(cfg, model_vocab_size(cfg.model))
        layout = plan_layout(cfg)
        backend = resolve_backend(cfg.cluster.backend)
        plan = plan_verdict(cfg)
        freeze_choices(cfg, plan.choices)
        refuse_another_runs_checkpoint(
            checkpoint_dir(cfg.run.dir), run_settings(cfg, layout, plan.choices.zero_stage)
        )
        if cfg.dry_run:
            print(describe_dry_run(cfg, backend, layout))
            print(plan.text)
            return 0
        executor = build_executor(cfg, backend)
        if not plan.fits:
            raise ConfigError(f"{plan.reason}\n{plan.text}")
        prepare_run_dir(cfg, submission, force=force)
    except ConfigError as err:
        return config_error(err)
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
        f"run directory {cfg.run.dir}; per-rank logs in {submitit_dir(cfg.run.dir)}",
        flush=True,
    )
    if cfg.follow is False or (cfg.follow is None and backend is Backend.slurm):
        print(next_steps(job, cfg.run.dir))
        return 0
    return follow(job, cfg.run.dir)


if __name__ == "__main__":
    sys.exit(main())
