"""What every rank runs: the callable submitit pickles into the job.

Above train in the dependency order (docs/architecture.md's layout). Importing train imports torch._dynamo, which exports torch's default
TORCHINDUCTOR_CACHE_DIR when imported; inductor reads the variable each time it opens its
cache, and DeepSpeed (imported by its engine when built) reads DS_ACCELERATOR on its first
get_accelerator(): both are set in `TrainingJob.__call__`, before either is used.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import submitit
import torch
import torch.distributed as dist

from slurm_autosp.cluster.comm_env import collective_env
from slurm_autosp.cluster.compile_cache import use_private_compile_cache, users_environment
from slurm_autosp.cluster.parallel_dims import ParallelDims, init_parallel_dims
from slurm_autosp.cluster.rank_failure import FailureWatch
from slurm_autosp.compat.torch_api import abort_process_groups
from slurm_autosp.config import ClusterConfig, ConfigError, JobConfig, Vendor
from slurm_autosp.lifecycle.lock import (
    RunLock,
    acquire_lock,
    release_lock,
    superseded,
    this_job,
)
from slurm_autosp.lifecycle.requeue import Requeued
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.lifecycle.run_setup import prepare_run_dir
from slurm_autosp.lifecycle.signals import StopRequest
from slurm_autosp.train import train

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LockClaim:
    """How the job takes its run's lock when it starts: the job itself holds the run."""

    handed_over_by: RunLock | None = None  # the submission holding the lock until the job starts
    force: bool = False  # take the lock even from a holder that cannot be checked
    record_config: bool = False  # a hand-submitted job (`run`) records its config itself


class TrainingJob:
    """Sets up the process, joins the process group, takes the run and trains; submitit calls
    it on every rank.

    Requeued jobs call it again with the same config: training resumes from the checkpoint.
    Once the process group is up, an error on one rank ends every rank, each naming it
    (cluster/rank_failure.py), instead of leaving the others waiting in a collective.
    """

    # saves when SLURM's pre-timeout signal comes, so admission holds its signal delay to a
    # step and a save
    saves_checkpoints = True

    def __init__(self, cfg: JobConfig, claim: LockClaim = LockClaim()):
        self.cfg = cfg
        self.claim = claim

    def __call__(self):
        stop = StopRequest.install()
        try:
            return self._run(stop)
        except Requeued as requeued:
            requeued.leave()  # after _run's cleanup: the process group is gone
        finally:
            stop.close()  # a job run in a test's process leaves its signals as it found them

    def _run(self, stop: StopRequest):
        cfg = self.cfg
        job_env = submitit.JobEnvironment()
        if job_env.num_tasks != cfg.cluster.world_size:
            raise RuntimeError(
                f"the job has {job_env.num_tasks} tasks but the config describes {cfg.cluster.world_size} "
                f"(cluster.nodes={cfg.cluster.nodes} x {cfg.cluster.ranks_per_node} ranks per node); "
                "request matching --nodes/--ntasks-per-node or fix cluster.*"
            )
        rank = job_env.global_rank
        _configure_process(cfg.cluster, rank)
        applied = _apply_collective_env(cfg)
        watch = FailureWatch()
        leave: Callable[[], object] = dist.destroy_process_group
        try:
            dims = init_parallel_dims(cfg, lambda rank: self._joined(rank, watch))
            if dims.rank == 0:
                log.info("%s", dims.layout)
                log.info(
                    "collective environment: %s",
                    " ".join(f"{k}={v}" for k, v in sorted(applied.items())),
                )
            result = self.work(dims, stop)
            if dims.rank == 0:
                release_lock(cfg.run.dir, this_job())
            return result
        except Requeued:  # every rank leaves for the requeue: no failure
            raise
        except BaseException as err:
            watch.failed(err)  # the other ranks end too, naming this rank and its error
            leave = abort_process_groups  # destroy would wait for collectives left unfinished
            raise
        finally:
            watch.stop()  # leaving: another rank's end (rank 0's takes the store) is no failure
            if dist.is_initialized():
                leave()

    def _joined(self, rank: int, watch: FailureWatch) -> None:
        """As soon as the process group is up: watch for another rank's failure, then claim
        the run."""
        watch.start(rank, dist.get_world_size())
        self._claim(rank)

    def _claim(self, rank: int) -> None:
        """Rank 0 takes the run's lock; every rank exits when it refuses."""
        refusal = _claim_run(self.cfg, self.claim) if rank == 0 else None
        shared = [refusal]
        dist.broadcast_object_list(shared, src=0)
        if shared[0] is not None:
            raise ConfigError(shared[0])

    def work(self, dims: ParallelDims, stop: StopRequest) -> Any:
        """What the job does once the process group, the run and the layout are set: train.
        A subclass does other work on the same path (the probe)."""
        job = this_job()

        def fence() -> str:
            return superseded(self.cfg.run.dir, job)

        return train(self.cfg, dims, stop, fence=fence, job=job)


def _claim_run(cfg: JobConfig, claim: LockClaim) -> str | None:
    """Rank 0 takes the run's lock for this job (kept across requeues); why not, if refused."""
    holder = this_job()
    try:
        if claim.record_config:
            prepare_run_dir(cfg, holder, force=claim.force)
        else:
            acquire_lock(
                cfg.run.dir,
                holder,
                handed_over_by=claim.handed_over_by,
                force=claim.force,
                what=f"run.name={cfg.run.name}: {cfg.run.dir}",
            )
    except (ConfigError, OSError) as err:
        return str(err)
    return None


def collective_env_for(cfg: JobConfig, inherited: Mapping[str, str]) -> dict[str, str]:
    """The NCCL/RCCL settings for this job's vendor and fabric, and its compile caches;
    `cluster.env` and anything in `inherited` (the job's own environment, less torch's default
    cache: see users_environment) win over ours."""
    c = cfg.cluster
    env = collective_env(
        c.vendor if c.uses_gpus else Vendor.none,
        c.fabric,
        user_env={**users_environment(inherited), **c.env},
        flight_recorder_prefix=str(RunDir(cfg.run.dir).flight_recorder_prefix),
        debug=c.debug_collectives,
        node_local_cache_dir=cfg.compile.cache_dir,
    )
    env.update(c.env)
    return env


def _apply_collective_env(cfg: JobConfig) -> dict[str, str]:
    """Export the settings before the process group starts (NCCL reads them at init), the
    compile caches as exported checked to be this user's alone."""
    env = collective_env_for(cfg, os.environ)
    os.environ.update(env)
    env.update(use_private_compile_cache(cfg.compile.cache_dir))
    if "TORCH_FR_DUMP_TEMP_FILE" in env:
        os.makedirs(os.path.dirname(env["TORCH_FR_DUMP_TEMP_FILE"]), exist_ok=True)
    return env


def _configure_process(cluster: ClusterConfig, rank: int) -> None:
    """Threads, accelerator choice and log format, before DeepSpeed or torch.compile start."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cluster.uses_gpus else "cpu")
    torch.set_num_threads(cluster.cpus_per_task)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s [rank {rank} on {socket.gethostname()}] %(message)s", "%H:%M:%S"
        )
    )
    logger = logging.getLogger("slurm_autosp")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
