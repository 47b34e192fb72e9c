"""What a rank runs in the multi-rank asynchronous save tests: an FSDP2 engine over the pool's
ranks, its first save staged under a given directory. Runs on every rank of a pool."""

import logging
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from slurm_autosp.checkpoint.async_save import CheckpointSaves
from slurm_autosp.checkpoint.store import CheckpointStore, TrainerState
from slurm_autosp.config import load_config
from slurm_autosp.engine import build_engine
from slurm_autosp.lifecycle.lock import RunLock


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _any_rank(flag: bool) -> bool:
    box = torch.tensor([int(flag)])
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return bool(box)


def first_fsdp2_save(root: str, staging_root: str) -> tuple[int, list[str], str]:
    """An FSDP2 engine's first save, asynchronous, staged under `staging_root` (the pool is the
    job: its process on this host), into `root`. Returns what this rank staged in its buffer,
    the checkpoints once no rank is writing, and the warnings logged."""
    world = dist.get_world_size()
    cfg = load_config([f"cluster.tasks_per_node={world}", "parallel.zero_stage=3"])
    torch.manual_seed(0)
    engine = build_engine(cfg, torch.device("cpu"), 3)
    store = CheckpointStore(Path(root), dist.get_rank(), world, keep=2)
    warnings = _Warnings()
    logging.getLogger("slurm_autosp.checkpoint").addHandler(warnings)
    pool = RunLock(str(os.getppid()), "local", socket.gethostname())
    saves = CheckpointSaves.start(store, True, staging_root, Path(root), job=pool)
    try:
        saves.save(engine, TrainerState(1, 1, world, "pool", engine.name), synchronous=False)
        staged = saves.staged_bytes
        while _any_rank(saves.writing()):
            time.sleep(0.05)
        saves.commit_written(False)
    finally:
        saves.close()
        engine.close()
        logging.getLogger("slurm_autosp.checkpoint").removeHandler(warnings)
    return staged, [p.name for p in store.checkpoints()], "\n".join(warnings.lines)
