"""What every rank runs: the callable submitit pickles into the job."""

from __future__ import annotations

import logging
import os
import socket
import sys

import submitit
import torch

from slurm_autosp.config import JobConfig


class TrainingJob:
    """Sets up the process, joins the process group and trains; submitit calls it on every rank."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg

    def __call__(self):
        from slurm_autosp.checkpoint.signals import StopRequest
        from slurm_autosp.launch.distributed import init_distributed
        from slurm_autosp.train import train

        stop = StopRequest.install()
        cfg = self.cfg
        rank = submitit.JobEnvironment().global_rank
        _configure_process(cfg, rank)
        ctx = init_distributed(cfg.cluster.uses_gpus, cfg.cluster.collective_timeout_min)
        try:
            return train(cfg, ctx, stop)
        finally:
            torch.distributed.destroy_process_group()


def _configure_process(cfg: JobConfig, rank: int) -> None:
    """Threads, accelerator choice and log format, before DeepSpeed or torch.compile start."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cfg.cluster.uses_gpus else "cpu")
    torch.set_num_threads(cfg.cluster.cpus_per_task)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [rank {rank} on {socket.gethostname()}] %(message)s", "%H:%M:%S")
    )
    logger = logging.getLogger("slurm_autosp")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
