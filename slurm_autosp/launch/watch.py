"""Follow a submitted job from a terminal: echo rank 0's log as it grows, and on the first
failing rank stop the job and show that rank's error and the tail of its log.

The log and the ranks' result files are read twice a second; the scheduler is asked whether a
SLURM job is still queued or running at most every SCHEDULER_POLL_S seconds per follower
(cluster admins block tools that call squeue in a loop). It is only needed when a job ends
without results (killed, out of memory), which is then noticed within that interval."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit

from slurm_autosp.cluster.scheduler import Liveness, slurm_job_liveness
from slurm_autosp.compat import submitit_api
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.verify.start_check import StartCheckFailed


class JobFailed(RuntimeError):
    """A rank of the job raised or died; the message names the rank and shows its log.
    `inexact`: it stopped before step 1 because its start check found AutoSP inexact."""

    def __init__(self, message: str, inexact: bool = False, secondary: bool = False):
        super().__init__(message)
        self.inexact = inexact
        self.secondary = secondary  # it failed because another rank died under it


# `submit` and `status --follow` exit with this when the job's start check failed: the model
# would train differently from one device (1 is a failed job, 2 a refused config)
EXIT_INEXACT = 3


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


SCHEDULER_POLL_S = 30.0


class _SchedulerPoll:
    """Whether the job has left the queue, asking SLURM at most every `interval_s` seconds
    (the first time one interval after following starts); local jobs are asked directly."""

    def __init__(self, job: submitit.Job, interval_s: float):
        self.job, self.interval_s = job, interval_s
        self.last = time.monotonic()
        self.queries = 0

    def ended(self) -> bool:
        if not isinstance(self.job, submitit.SlurmJob):
            return bool(self.job.done())
        if time.monotonic() - self.last < self.interval_s:
            return False
        self.last = time.monotonic()
        self.queries += 1
        return slurm_job_liveness(str(self.job.job_id))[0] is Liveness.gone


def wait_for_job(
    job: submitit.Job,
    echo: Callable[[str], None] = print,
    poll_s: float = 0.5,
    scheduler_poll_s: float = SCHEDULER_POLL_S,
) -> list[Any]:
    """Every rank's result, in rank order; raises JobFailed naming the first rank that failed."""
    tasks = [job.task(i) for i in range(job.num_tasks)]
    follower = _LogFollower(tasks[0].paths.stdout)
    scheduler = _SchedulerPoll(job, scheduler_poll_s)
    while True:
        _echo_lines(follower.new_text(), echo)
        failure = _first_failure(tasks)
        if failure is not None and failure.secondary:
            failure = _cause_of(tasks, failure, poll_s)
        if failure is not None:
            if not job.done():
                job.cancel(check=False)
            raise failure
        if all(t.paths.result_pickle.exists() for t in tasks):
            _echo_lines(follower.new_text(), echo)
            return [submitit_api.pickle_load(t.paths.result_pickle)[1] for t in tasks]
        if scheduler.ended():
            missing = [i for i, t in enumerate(tasks) if not t.paths.result_pickle.exists()]
            raise JobFailed(
                f"job {job.job_id} ended (state {job.state}) but rank(s) {missing} returned no "
                f"result: killed or out of memory?\n" + _log_tail(tasks[missing[0]], missing[0])
            )
        time.sleep(poll_s)


# what a rank raises when another rank died under it: the cause is that other rank's error
PEER_DIED = ("Connection closed by peer", "remote worker crashing", "communicator was aborted")
CAUSE_WAIT_S = 15.0


def _cause_of(tasks: list[submitit.Job], failure: JobFailed, poll_s: float) -> JobFailed:
    """A rank that failed because a peer died is not the cause: give the peer's own error a
    few seconds to arrive, and report it instead."""
    deadline = time.monotonic() + CAUSE_WAIT_S
    while time.monotonic() < deadline:
        cause = _first_failure(tasks, primary_only=True)
        if cause is not None:
            return cause
        time.sleep(poll_s)
    return failure


def _first_failure(tasks: list[submitit.Job], primary_only: bool = False) -> JobFailed | None:
    for rank, task in enumerate(tasks):
        if not task.paths.result_pickle.exists():
            continue
        outcome, payload = submitit_api.pickle_load(task.paths.result_pickle)
        if outcome == "error":
            marker = f"{StartCheckFailed.__name__}: "
            if marker in str(payload):  # verify's report says it all; no traceback or log tail
                report = str(payload).split(marker, 1)[1].rstrip()
                return JobFailed(f"stopped before step 1:\n{report}", inexact=True)
            secondary = any(sign in str(payload) for sign in PEER_DIED)
            if primary_only and secondary:
                continue
            return JobFailed(
                f"rank {rank} failed:\n{str(payload).rstrip()}\n" + _log_tail(task, rank),
                secondary=secondary,
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


def next_steps(job: submitit.Job, run_dir: Path) -> str:
    """How to follow, check and cancel a job that runs on without this terminal: commands to
    paste, the paths quoted (a run name may hold spaces, '#' or quotes)."""
    cancel = f"scancel {job.job_id}" if isinstance(job, submitit.SlurmJob) else f"kill {job.job_id}"
    run = shlex.quote(str(run_dir))
    return "\n".join(
        [
            f"  follow:      python -m slurm_autosp status {run} --follow",
            f"  rank 0 log:  {shlex.quote(str(job.task(0).paths.stdout))}",
            f"  status:      python -m slurm_autosp status {run}",
            f"  cancel:      {cancel}",
            f"  TensorBoard: {tensorboard_command(run_dir)}",
        ]
    )


def tensorboard_command(run_dir: Path) -> str:
    return f"tensorboard --logdir {shlex.quote(str(RunDir(run_dir).tensorboard))}"


def follow(job: submitit.Job, run_dir: Path) -> int:
    """Echo rank 0's log until the job ends: 0 when every rank finished, 1 when one failed,
    EXIT_INEXACT when the start check stopped it.
    Ctrl-C detaches from a SLURM job, which runs on (a terminal never cancels a multi-node
    job by itself), and cancels local processes."""
    try:
        wait_for_job(job, echo=lambda line: print(line, flush=True))
    except JobFailed as err:
        print(f"error: job {job.job_id}: {err}", file=sys.stderr)
        return EXIT_INEXACT if err.inexact else 1
    except KeyboardInterrupt:
        if isinstance(job, submitit.SlurmJob):
            print(f"\ndetached: job {job.job_id} keeps running\n{next_steps(job, run_dir)}")
            return 0
        job.cancel(check=False)
        print(f"\ninterrupted: cancelled job {job.job_id}", file=sys.stderr)
        return 130
    print(f"job {job.job_id} finished; TensorBoard: {tensorboard_command(run_dir)}")
    return 0
