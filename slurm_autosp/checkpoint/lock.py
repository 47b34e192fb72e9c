"""One live job per run: two jobs training the same run would overwrite each other's
checkpoints. The lock is a file naming the job; it survives crashes, and a lock whose job is
no longer alive (SLURM forgot it, or the local process is gone) is stale and taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

LOCK = "job.lock"


@dataclass(frozen=True)
class RunLock:
    job_id: str
    backend: str  # "slurm" | "local"
    host: str

    def describe(self) -> str:
        return f"job {self.job_id} ({self.backend} on {self.host})"


def read_lock(run_dir: Path) -> RunLock | None:
    try:
        return RunLock(**json.loads((run_dir / LOCK).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_lock(run_dir: Path, job_id: str, backend: str) -> None:
    tmp = run_dir / f".{LOCK}.tmp"
    tmp.write_text(json.dumps(asdict(RunLock(str(job_id), backend, socket.gethostname()))))
    os.replace(tmp, run_dir / LOCK)


def release_lock(run_dir: Path, job_id: str) -> None:
    lock = read_lock(run_dir)
    if lock is not None and lock.job_id == str(job_id):
        (run_dir / LOCK).unlink(missing_ok=True)


def live_holder(run_dir: Path) -> RunLock | None:
    """The job holding the run, if it is still alive."""
    lock = read_lock(run_dir)
    if lock is None:
        return None
    return lock if _alive(lock) else None


def _alive(lock: RunLock) -> bool:
    if lock.backend == "slurm":
        try:
            state = subprocess.run(
                ["squeue", "-h", "-j", lock.job_id, "-o", "%T"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            return True  # cannot tell: refusing is safer than two writers
        return bool(state.stdout.strip())
    if lock.host != socket.gethostname():
        return True  # a local job on another machine: cannot check its process from here
    try:
        os.kill(int(lock.job_id), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True
