"""One live job per run: two jobs training the same run would overwrite each other's
checkpoints. The lock is a file naming its holder, created atomically (a hard link of a
complete file, which fails when the lock exists), so two submissions racing for a run cannot
both win. `submit` takes it before the job is queued and hands it to the job; the job claims it
on start (`run` jobs take it themselves) and keeps it across requeues.

A lock whose holder is gone (SLURM no longer knows the job, or the local process exited) is
stale and taken over. A holder that cannot be checked (the controller does not answer, a local
job on another host) counts as alive: refusing is safer than two writers; `--force` takes the
lock anyway, for a user who knows the job is gone.

SLURM may requeue a job whose node it lost while that node still runs it: two starts of one
job id then live at once. The lock records the start that claimed it (SLURM_RESTART_COUNT);
the later start claims it over the earlier one, and a start that finds itself superseded
(`superseded`) writes no checkpoint, deletes none, requeues nothing and leaves the lock in
place. A missing lock supersedes too: the job no longer holds the run (someone removed the
lock, or another job is taking the run over)."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import submitit

from slurm_autosp.cluster.scheduler import Liveness, slurm_job_liveness
from slurm_autosp.config import ConfigError
from slurm_autosp.lifecycle.run_dir import RunDir

SUBMITTING = "submit"  # the backend named by a lock a submission holds until its job is queued
ABANDONED_CLAIM_S = 60  # a takeover's claim older than this was left by a taker that died


@dataclass(frozen=True)
class RunLock:
    job_id: str  # SLURM job id; the local job's (or the submitting process's) pid
    backend: str  # "slurm" | "local" | SUBMITTING
    host: str
    restart: int = 0  # which start of the job claimed the lock (SLURM_RESTART_COUNT)

    def same_holder(self, other: RunLock | None) -> bool:
        """Whether `other` names the same job: a Slurm job by its id, which is unique on its
        cluster whichever node it runs on; a local job or a submission by its process id on
        its host. A process id never matches a Slurm job id, however equal the numbers."""
        if other is None or (self.backend, self.job_id) != (other.backend, other.job_id):
            return False
        return self.backend == "slurm" or self.host == other.host

    def describe(self) -> str:
        if self.backend == SUBMITTING:
            return f"a submission in progress (process {self.job_id} on {self.host})"
        return f"job {self.job_id} ({self.backend} on {self.host})"


def this_process() -> RunLock:
    """Training outside a submitted job (a test, a notebook): the process, as a local job."""
    return RunLock(str(os.getpid()), "local", socket.gethostname())


def this_job() -> RunLock:
    """The running job (any of its ranks), as the run's lock names it."""
    job_env = submitit.JobEnvironment()
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    return RunLock(job_env.job_id, job_env.cluster, socket.gethostname(), restart)


def superseded(run_dir: Path, job: RunLock) -> str:
    """Why `job` may no longer write the run: no lock, or one naming another holder or a later
    start of the same job; empty while it holds the lock. A job has claimed the lock before it
    writes, so a missing one was removed since, or is mid-takeover by another job."""
    try:
        lock = read_lock(run_dir)
    except ConfigError as err:
        return str(err)
    if lock is None:
        return (
            f"{RunDir(run_dir).lock} is gone: this job no longer holds the run (the lock was "
            "removed, or another job is taking the run over)"
        )
    if not lock.same_holder(job):
        return f"{RunDir(run_dir).lock} names {lock.describe()}, not this job"
    if lock.restart > job.restart:
        return (
            f"SLURM started job {job.job_id} again (restart {lock.restart}) while this start "
            f"(restart {job.restart}) still ran; that start trains the run now"
        )
    return ""


def read_lock(run_dir: Path) -> RunLock | None:
    stamped = _read_stamped(run_dir)
    return stamped[0] if stamped else None


def _read_stamped(run_dir: Path) -> tuple[RunLock, tuple[int, int]] | None:
    """The lock and its file's identity (inode, modification time), read from one open file:
    a takeover removes only the very file it found stale."""
    try:
        with open(RunDir(run_dir).lock) as f:
            info = os.fstat(f.fileno())
            return RunLock(**json.loads(f.read())), (info.st_ino, info.st_mtime_ns)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(
            f"{RunDir(run_dir).lock} is not a lock this tool wrote ({err}); if no job trains this run, "
            "remove it or submit with --force"
        ) from err


def holder_liveness(lock: RunLock) -> tuple[Liveness, str]:
    """Whether the lock's holder still runs, and why it is unknown when it is."""
    if lock.backend == "slurm":
        return slurm_job_liveness(lock.job_id)
    if lock.host != socket.gethostname():
        return Liveness.unknown, f"a process on {lock.host} cannot be checked from here"
    try:
        os.kill(int(lock.job_id), 0)
    except (ProcessLookupError, ValueError):
        return Liveness.gone, ""
    except PermissionError:
        return Liveness.alive, ""
    return Liveness.alive, ""


def acquire_lock(
    run_dir: Path,
    holder: RunLock,
    *,
    handed_over_by: RunLock | None = None,
    force: bool = False,
    what: str = "run",
) -> None:
    """Take the run's lock for `holder`, atomically. Already ours (a requeue), or held by the
    submission `handed_over_by` names: rewritten for `holder`. Held by a job that is gone, or
    `force`: taken over. Otherwise a ConfigError names the holder and what to do."""
    run = RunDir(run_dir)
    path, mine = run.lock, run.lock_temporary(uuid.uuid4().hex)
    mine.write_text(json.dumps(asdict(holder)))
    try:
        while True:
            try:
                os.link(mine, path)
                return
            except FileExistsError:
                pass
            try:
                stamped = _read_stamped(run_dir)
            except ConfigError:
                if not force:
                    raise
                stamped = None
            if stamped is None:
                if force:
                    path.unlink(missing_ok=True)
                continue
            current = stamped[0]
            if current.same_holder(holder) and current.restart > holder.restart:
                raise ConfigError(superseded(run_dir, holder))
            if current.same_holder(holder) or current.same_holder(handed_over_by):
                os.replace(mine, path)
                return
            liveness, why = holder_liveness(current)
            if liveness is Liveness.gone or force:
                _take_over(run_dir, stamped, mine)
                continue
            raise ConfigError(_refusal(current, liveness, why, what))
    finally:
        mine.unlink(missing_ok=True)


def _take_over(run_dir: Path, stale: tuple[RunLock, tuple[int, int]], mine: Path) -> None:
    """Remove the stale lock, unless its file has changed since it was read. Of the takers
    racing for it, only the one whose claim (a hard link named by the stale file's identity)
    is created removes it, and only while that file is still in place: a taker that read it
    late can never remove the lock another has just taken. A claim left by a taker that died
    is removed once it is a minute old."""
    ino, mtime_ns = stale[1]
    claim = RunDir(run_dir).lock_takeover(ino, mtime_ns)
    try:
        os.link(mine, claim)
    except FileExistsError:
        try:
            if time.time() - claim.stat().st_mtime > ABANDONED_CLAIM_S:
                claim.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        time.sleep(0.05)  # another taker holds the claim: look again once it is done
        return
    try:
        os.utime(claim)  # its age is the claim's, not that of the file it links
        if _read_stamped(run_dir) == stale:
            RunDir(run_dir).lock.unlink()
    except ConfigError:
        pass  # no longer the stale lock: whatever it is now, the loop reads it again
    finally:
        claim.unlink(missing_ok=True)


def _refusal(holder: RunLock, liveness: Liveness, why: str, what: str) -> str:
    if liveness is Liveness.alive:
        cancel = f" (scancel {holder.job_id})" if holder.backend == "slurm" else ""
        return (
            f"{what} is being trained by {holder.describe()}; wait for it, cancel it{cancel}, "
            "or choose another run.name"
        )
    return (
        f"{what} is locked by {holder.describe()}, which cannot be checked ({why}); wait until "
        "it can be, or, if you are sure that job no longer runs, add --force to take the run over"
    )


def release_lock(run_dir: Path, holder: RunLock) -> None:
    """Remove the lock if `holder` holds it: not when a later start of its job claimed it
    since (the earlier start ending would leave the run unlocked under the later one)."""
    try:
        lock = read_lock(run_dir)
    except ConfigError:
        return
    if lock is not None and lock.same_holder(holder) and lock.restart <= holder.restart:
        RunDir(run_dir).lock.unlink(missing_ok=True)
