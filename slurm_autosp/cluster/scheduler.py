"""Whether a SLURM job still runs, asked of squeue: the one place the tool queries the
scheduler about a job (the run lock and the follower both ask here)."""

from __future__ import annotations

import enum
import subprocess

# What squeue prints for a job that will not run again (it shows these for MinJobAge seconds).
ENDED_STATES = frozenset(
    "BOOT_FAIL CANCELLED COMPLETED DEADLINE FAILED NODE_FAIL OUT_OF_MEMORY PREEMPTED "
    "SPECIAL_EXIT TIMEOUT".split()
)


class Liveness(enum.Enum):
    alive = "alive"
    gone = "gone"
    unknown = "unknown"  # the scheduler did not answer


def slurm_job_liveness(job_id: str) -> tuple[Liveness, str]:
    """Whether the job is queued or running, and why it is unknown when it is."""
    try:
        proc = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return Liveness.unknown, f"squeue failed: {err}"
    if proc.returncode == 0:
        states = set(proc.stdout.split())
        return (Liveness.alive if states - ENDED_STATES else Liveness.gone), ""
    if "Invalid job id" in proc.stderr:
        return Liveness.gone, ""  # SLURM has forgotten the job: it ended a while ago
    return Liveness.unknown, f"squeue failed: {proc.stderr.strip() or f'exit {proc.returncode}'}"
