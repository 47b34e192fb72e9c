"""Follow a submitted job from the submitting terminal: echo rank 0's log as it grows, and on
the first failing rank stop the job and show that rank's error and the tail of its log."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import pickle_load


class JobFailed(RuntimeError):
    """A rank of the job raised or died; the message names the rank and shows its log."""


@dataclass
class _LogFollower:
    path: Path
    offset: int = 0

    def new_text(self) -> str:
        if not self.path.exists():
            return ""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return complete.decode(errors="replace")


def wait_for_job(
    job: submitit.Job, echo: Callable[[str], None] = print, poll_s: float = 0.5
) -> list[Any]:
    """Every rank's result, in rank order; raises JobFailed naming the first rank that failed."""
    tasks = [job.task(i) for i in range(job.num_tasks)]
    follower = _LogFollower(tasks[0].paths.stdout)
    while True:
        _echo_lines(follower.new_text(), echo)
        failure = _first_failure(tasks)
        if failure is not None:
            if not job.done():
                job.cancel(check=False)
            raise failure
        if all(t.paths.result_pickle.exists() for t in tasks):
            _echo_lines(follower.new_text(), echo)
            return [pickle_load(t.paths.result_pickle)[1] for t in tasks]
        if _ended(job):
            missing = [i for i, t in enumerate(tasks) if not t.paths.result_pickle.exists()]
            raise JobFailed(
                f"job {job.job_id} ended (state {job.state}) but rank(s) {missing} returned no "
                f"result: killed or out of memory?\n" + _log_tail(tasks[missing[0]], missing[0])
            )
        time.sleep(poll_s)


def _ended(job: submitit.Job) -> bool:
    """Whether the job has left the queue. Without SLURM accounting (sacct) submitit never
    learns that a SLURM job ended, so ask squeue, which lists only live jobs."""
    if not isinstance(job, submitit.SlurmJob):
        return job.done()
    try:
        state = subprocess.run(
            ["squeue", "-h", "-j", str(job.job_id), "-o", "%T"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return False
    return state not in _LIVE_STATES


_LIVE_STATES = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SUSPENDED",
    "PREEMPTED",
    "STOPPED",
    "SIGNALING",
    "STAGE_OUT",
}


def _first_failure(tasks: list[submitit.Job]) -> JobFailed | None:
    for rank, task in enumerate(tasks):
        if not task.paths.result_pickle.exists():
            continue
        outcome, payload = pickle_load(task.paths.result_pickle)
        if outcome == "error":
            return JobFailed(
                f"rank {rank} failed:\n{str(payload).rstrip()}\n" + _log_tail(task, rank)
            )
    return None


def _log_tail(task: submitit.Job, rank: int, lines: int = 30) -> str:
    parts = []
    for path in (task.paths.stdout, task.paths.stderr):
        if path.exists():
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(
                f"--- last {len(tail)} lines of rank {rank}'s {path} ---\n" + "\n".join(tail)
            )
    return "\n".join(parts) or f"(rank {rank} wrote no log under {task.paths.folder})"


def _echo_lines(text: str, echo: Callable[[str], None]) -> None:
    for line in text.splitlines():
        echo(line)
