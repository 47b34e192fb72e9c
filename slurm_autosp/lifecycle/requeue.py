"""Put the job back in the queue after a save, on SLURM and for local processes alike, at most
`cluster.max_requeues` times per job. Each requeue is recorded in the run directory
(requeues.jsonl, a line per requeue): locally it is the only count there is (submitit's local
controller restarts up to a fixed number of times of its own), and `status` reads it."""

from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import submitit
import torch.distributed as dist

from slurm_autosp.compat import submitit_api
from slurm_autosp.lifecycle.lock import superseded, this_job
from slurm_autosp.lifecycle.run_dir import RunDir

log = logging.getLogger(__name__)

# submitit's local controller starts a job at most 6 times (`Controller.run`), whatever the
# countdown a requeue hands it: a 6th requeue would end the job with no result
LOCAL_MAX_REQUEUES = 5


def recorded_requeues(run_dir: Path) -> list[dict[str, str | int]]:
    """Every requeue of the run, oldest first; unreadable lines are skipped."""
    try:
        lines = RunDir(run_dir).requeues.read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def restarts_so_far(run_dir: Path, job_id: str) -> int:
    """SLURM's count of this job's restarts, or the run's record of them, whichever is more:
    SLURM also restarts a job it preempts, and local jobs have no count but the record."""
    recorded = sum(1 for r in recorded_requeues(run_dir) if r.get("job_id") == job_id)
    return max(int(os.environ.get("SLURM_RESTART_COUNT", "0")), recorded)


def _record(run_dir: Path, job_id: str, restart: int) -> None:
    line = {
        "job_id": job_id,
        "restart": restart,
        "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    with open(RunDir(run_dir).requeues, "a") as f:
        f.write(json.dumps(line) + "\n")


def requeue_and_exit(run_dir: Path, rank: int, max_requeues: int) -> NoReturn:
    """Rank 0 records the requeue and requeues (`scontrol requeue` on SLURM; a restart of all
    ranks locally); every rank then raises Requeued, to exit without a result, so the requeued
    job starts from the checkpoint. Past `max_requeues` every rank stops with an error instead."""
    job_env = submitit.JobEnvironment()
    restarts = restarts_so_far(run_dir, job_env.job_id)
    dist.barrier()  # every rank has the count before rank 0 records this requeue
    if restarts >= max_requeues:
        raise RuntimeError(
            f"stopped by a signal after {restarts} requeues (cluster.max_requeues={max_requeues}); "
            "the last checkpoint is saved: submit the same run again to resume, or raise cluster.max_requeues"
        )
    if job_env.cluster == "local" and restarts >= LOCAL_MAX_REQUEUES:
        raise RuntimeError(
            f"stopped by a signal after {restarts} requeues: submitit's local controller starts "
            f"a job at most {LOCAL_MAX_REQUEUES + 1} times, whatever cluster.max_requeues says; "
            "the last checkpoint is saved: submit the same run again to resume"
        )
    if rank == 0:
        fenced = superseded(run_dir, this_job())
        if fenced:  # a requeue of the job id would requeue the start that trains the run now
            raise RuntimeError(f"not requeueing: {fenced}")
        log.info("requeueing (restart %d of at most %d)", restarts + 1, max_requeues)
        _record(run_dir, job_env.job_id, restarts + 1)
        try:
            submitit_api.requeue(job_env, max_requeues - restarts - 1)
        except subprocess.CalledProcessError as err:
            # On preemption with PreemptMode=REQUEUE, SLURM is requeueing the job itself.
            log.warning("scontrol requeue failed (%s); relying on SLURM's own requeue", err)
        except SystemExit as local:  # submitit's local controller restarts on this exit code
            raise Requeued(local.code) from None
    raise Requeued(0)


class Requeued(SystemExit):
    """This rank leaves a requeued job: its callers' cleanup runs as the exception passes, then
    the job's entry point calls `leave`."""

    def leave(self) -> NoReturn:
        """End the process now, with the exit code the requeue asks for. The interpreter's own
        teardown would free every object a compiled model made, for seconds that a preemption's
        kill may not leave; the checkpoint is on storage and nothing here needs freeing."""
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.code if isinstance(self.code, int) else 1)
