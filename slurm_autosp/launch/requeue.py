"""Put the job back in the queue after a save, on SLURM and for local processes alike."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import NoReturn

import submitit

log = logging.getLogger(__name__)


def restarts_so_far() -> int:
    return int(os.environ.get("SLURM_RESTART_COUNT", "0"))


def requeue_and_exit(rank: int, max_requeues: int) -> NoReturn:
    """Rank 0 requeues (`scontrol requeue` on SLURM; a restart of all ranks locally); every
    rank then exits without a result, so the requeued job starts from the checkpoint."""
    restarts = restarts_so_far()
    if restarts >= max_requeues:
        raise RuntimeError(
            f"stopped by a signal after {restarts} requeues (cluster.max_requeues={max_requeues}); "
            "the last checkpoint is saved: submit the same run again to resume, or raise cluster.max_requeues"
        )
    if rank == 0:
        log.info("requeueing (restart %d of at most %d)", restarts + 1, max_requeues)
        try:
            # submitit's per-backend requeue: scontrol on SLURM, the local controller's exit code otherwise.
            submitit.JobEnvironment()._requeue(max_requeues - restarts - 1)
        except subprocess.CalledProcessError as err:
            # On preemption with PreemptMode=REQUEUE, SLURM is requeueing the job itself.
            log.warning("scontrol requeue failed (%s); relying on SLURM's own requeue", err)
    sys.exit(0)
